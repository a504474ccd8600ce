"""Lowerings: nn ops (softmax, normalization, activations, losses, dropout, recurrent cells,
grouped matmul, attention).

Half-precision inputs are computed in float32 and cast back, as torch's CPU
kernels do. Backward ops whose formula is just the derivative of the forward
are the `jax.vjp` of the forward lowering.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch._decomp import decomposition_table as _TORCH_DECOMPOSITIONS

from .. import dtypes as _dt
from .. import env as _env
from ..dispatch import OpError, TorchRuntimeError, TorchValueError
from .indexing import raise_as_torch, stand_in
from .linalg import _acc_dtype, _precision
from .registry import (HALF_DTYPES, broadcast_shapes, canonical_dim, check_values, checked_scalar, decomposition,
                       refused_dtypes, register, scalar_type_name, torch_slopes, true_divide)
from .shape import is_traced

aten = torch.ops.aten
prims = torch.ops.prims

_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_F32 = np.dtype(np.float32)
_LONG = np.dtype(np.int64)
_BYTE = np.dtype(np.uint8)


def upcast(x):
    """``x`` in the dtype torch computes it in: float32 for float16 / bfloat16."""
    if x is None or not hasattr(x, "dtype"):
        return x
    return x.astype(_F32) if x.dtype in _HALF else x


def _cast_like(out, dtype):
    if isinstance(out, (tuple, list)):
        return type(out)(_cast_like(o, dtype) for o in out)
    return out if out is None or out.dtype == dtype else out.astype(dtype)


def upcasting(fn):
    """``fn`` with its array arguments upcast (see `upcast`) and its results in the dtype
    of its first array argument; ``fn`` itself is its ``compute``."""

    @functools.wraps(fn)
    def lowering(*args, **kwargs):
        dtype = next(a.dtype for a in args if hasattr(a, "dtype"))
        return _cast_like(fn(*(upcast(a) for a in args), **kwargs), dtype)

    lowering.compute = fn
    return lowering


def float_op(*ops):
    """Register an `upcasting` lowering of ``ops``."""

    def deco(fn):
        return register(*ops)(upcasting(fn))

    return deco


def _vjp(fn, primals, cotangent):
    """The gradients of ``fn`` at ``primals`` (a tuple) for the output cotangent."""
    out, pullback = jax.vjp(fn, *primals)
    return pullback(cotangent.astype(out.dtype))


def _unary_backward(forward):
    """``backward(grad, x, *args)``: the derivative of ``forward(x, *args)``."""

    def backward(grad, x, *args, **kwargs):
        return _vjp(lambda a: forward(a, *args, **kwargs), (x,), grad)[0]

    return backward


# -- softmax -------------------------------------------------------------------


def _softmax_dtype(x, half_to_float):
    return _F32 if half_to_float and x.dtype in _HALF else x.dtype


def _over_dim(fn, x, dim, *arrays):
    """``fn(x, *arrays, axis)`` along torch's ``dim``; a 0-d tensor is a 1-element vector, as in torch."""
    axis = canonical_dim(dim, x.ndim)
    if x.ndim:
        return fn(x, *arrays, axis=axis)
    return fn(x.reshape(1), *(a.reshape(1) for a in arrays), axis=0).reshape(())


def _floating_only(call, x):
    """torch's CPU softmax kernels have no integer, bool or complex version: their error."""
    if not _dt.is_floating(x.dtype):
        raise_as_torch(call, stand_in(x.dtype, 1), 0)


@register(aten._softmax.default)
def _softmax(x, dim, half_to_float):
    _floating_only(torch.softmax, x)
    return _over_dim(jax.nn.softmax, upcast(x), dim).astype(_softmax_dtype(x, half_to_float))


@register(aten._log_softmax.default)
def _log_softmax(x, dim, half_to_float):
    _floating_only(torch.log_softmax, x)
    return _over_dim(jax.nn.log_softmax, upcast(x), dim).astype(_softmax_dtype(x, half_to_float))


def _safe_softmax_compute(x, *, axis):
    """softmax that gives 0 (not NaN) on slices that are entirely -inf."""
    dead = jnp.all(x == -jnp.inf, axis=axis, keepdims=True)
    out = jax.nn.softmax(jnp.where(dead, jnp.zeros((), x.dtype), x), axis=axis)
    return jnp.where(dead, jnp.zeros((), out.dtype), out)


@register(aten._safe_softmax.default)
def _safe_softmax(x, dim, dtype=None):
    out_dtype = _dt.to_jax(dtype) if dtype is not None else x.dtype
    x = x.astype(out_dtype) if dtype is not None else x
    return _over_dim(_safe_softmax_compute, upcast(x), dim).astype(out_dtype)


def _softmax_vjp(y, g, axis):
    return y * (g - jnp.sum(g * y, axis=axis, keepdims=True))


def _log_softmax_vjp(y, g, axis):
    return g - jnp.exp(y) * jnp.sum(g, axis=axis, keepdims=True)


@register(aten._softmax_backward_data.default)
def _softmax_backward_data(grad, out, dim, input_dtype):
    return _over_dim(_softmax_vjp, upcast(out), dim, upcast(grad)).astype(_dt.to_jax(input_dtype))


@register(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(grad, out, dim, input_dtype):
    return _over_dim(_log_softmax_vjp, upcast(out), dim, upcast(grad)).astype(_dt.to_jax(input_dtype))


# -- normalization ---------------------------------------------------------------


def _stat_dtype(x, weight):
    """torch's dtype for saved mean / rstd: the parameters' when they differ from the input's."""
    if weight is not None and weight.dtype != x.dtype:
        return weight.dtype
    return x.dtype


def _affine(out, weight, bias, shape):
    if weight is not None:
        out = out * upcast(weight).reshape(shape)
    if bias is not None:
        out = out + upcast(bias).reshape(shape)
    return out


def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = upcast(x)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = _affine((xf - mean) * rstd, weight, bias, tuple(normalized_shape))
    return out.astype(x.dtype), mean, rstd


def _check_layer_norm(x, normalized_shape, weight, bias):
    shape = [int(n) for n in normalized_shape]
    if not shape:
        raise RuntimeError("Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one "
                           "element, but got normalized_shape = []")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and list(p.shape) != shape:
            raise RuntimeError(f"Expected {name} to be of same shape as normalized_shape, but got {name} of shape "
                               f"{list(p.shape)} and normalized_shape = {shape}")
    if x.ndim < len(shape) or list(x.shape[x.ndim - len(shape):]) != shape:
        raise RuntimeError(f"Given normalized_shape={shape}, expected input with shape [*, {', '.join(map(str, shape))}], "
                           f"but got input of size{list(x.shape)}")


# torch's CPU normalization kernels are floating only (the running statistics' updates mutate: named overloads)
refused_dtypes(aten.native_layer_norm, aten.native_group_norm, aten.native_batch_norm.default,
               aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
               aten._batch_norm_with_update.default, kinds="bic")


@register(aten.native_layer_norm.default)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    _check_layer_norm(x, normalized_shape, weight, bias)
    out, mean, rstd = _layer_norm(x, normalized_shape, weight, bias, eps)
    stat = _stat_dtype(x, weight)
    return out, mean.astype(stat), rstd.astype(stat)


def _normalized_grad(g, xhat, rstd, axes):
    """d loss / d x of ``xhat = (x - mean(x)) * rstd(x)`` over ``axes``, given d loss / d xhat."""
    return rstd * (g - jnp.mean(g, axis=axes, keepdims=True) - xhat * jnp.mean(g * xhat, axis=axes, keepdims=True))


def _param_grads(g, xhat, weight, bias, output_mask, axes, shape):
    gw = jnp.sum(g * xhat, axis=axes).reshape(shape).astype(weight.dtype) if weight is not None and output_mask[1] else None
    gb = jnp.sum(g, axis=axes).reshape(shape).astype(bias.dtype) if bias is not None and output_mask[2] else None
    return gw, gb


@register(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    k = x.ndim - len(normalized_shape)
    g, xf = upcast(grad), upcast(x)
    mean, rstd = upcast(mean), upcast(rstd)
    xhat = (xf - mean) * rstd
    gx = None
    if output_mask[0]:
        gxhat = g * upcast(weight) if weight is not None else g
        gx = _normalized_grad(gxhat, xhat, rstd, tuple(range(k, x.ndim))).astype(x.dtype)
    gw, gb = _param_grads(g, xhat, weight, bias, output_mask, tuple(range(k)), tuple(normalized_shape))
    return gx, gw, gb


def _channel_shape(x):
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _group_norm(x, weight, bias, n, group, eps):
    xf = upcast(x).reshape(n, group, x.size // max(n * group, 1))
    mean = jnp.mean(xf, axis=2, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=2, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = ((xf - mean) * rstd).reshape(x.shape)
    return _affine(out, weight, bias, _channel_shape(x)).astype(x.dtype), mean[..., 0], rstd[..., 0]


@register(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, n, c, hxw, group, eps):
    out, mean, rstd = _group_norm(x, weight, bias, n, group, eps)
    stat = _stat_dtype(x, weight)
    return out, mean.astype(stat), rstd.astype(stat)


@register(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad, x, mean, rstd, weight, n, c, hxw, group, output_mask):
    shape = (n, c, hxw)
    g, xf = upcast(grad).reshape(shape), upcast(x).reshape(shape)
    mean = upcast(mean).reshape(n, group, 1, 1)
    rstd = upcast(rstd).reshape(n, group, 1, 1)
    grouped = (n, group, c // group, hxw)
    xhat = ((xf.reshape(grouped) - mean) * rstd).reshape(shape)
    gx = None
    if output_mask[0]:
        gxhat = g * upcast(weight).reshape(1, c, 1) if weight is not None else g
        gx = _normalized_grad(gxhat.reshape(grouped), xhat.reshape(grouped), rstd, (2, 3))
        gx = gx.reshape(x.shape).astype(x.dtype)
    dtype = weight.dtype if weight is not None else x.dtype
    gw = jnp.sum(g * xhat, axis=(0, 2)).astype(dtype) if weight is not None and output_mask[1] else None
    gb = jnp.sum(g, axis=(0, 2)).astype(dtype) if output_mask[2] else None
    return gx, gw, gb


def _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_rstd, new_running_mean, new_running_var) as torch's batch norm."""
    axes = (0,) + tuple(range(2, x.ndim))
    shape = _channel_shape(x)
    xf = upcast(x)
    stat = _stat_dtype(x, weight)
    if training:
        mean = jnp.mean(xf, axis=axes)
        var = jnp.mean(jnp.square(xf - mean.reshape(shape)), axis=axes)
        rstd = jax.lax.rsqrt(var + eps)
        new_mean, new_var = running_mean, running_var
        if running_mean is not None:
            count = x.size // x.shape[1]
            unbiased = var * (count / max(count - 1, 1))
            new_mean = ((1 - momentum) * upcast(running_mean) + momentum * mean).astype(running_mean.dtype)
            new_var = ((1 - momentum) * upcast(running_var) + momentum * unbiased).astype(running_var.dtype)
        save_mean, save_rstd = mean.astype(stat), rstd.astype(stat)
        if stat == np.float16:
            # torch CPU normalizes float16 with the saved statistics, rounded to float16
            # (measured: exact for float16; bfloat16 matches neither way exactly and
            # is closer unrounded)
            mean, rstd = upcast(save_mean), upcast(save_rstd)
    else:
        mean, rstd = upcast(running_mean), jax.lax.rsqrt(upcast(running_var) + eps)
        new_mean, new_var = running_mean, running_var
        save_mean = save_rstd = jnp.zeros((0,), stat)
    out = _affine((xf - mean.reshape(shape)) * rstd.reshape(shape), weight, bias, shape)
    return out.astype(x.dtype), save_mean, save_rstd, new_mean, new_var


@register(aten._native_batch_norm_legit_functional.default)
def _native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)


@register(aten._native_batch_norm_legit.no_stats)
def _native_batch_norm_legit_no_stats(x, weight, bias, training, momentum, eps):
    return _batch_norm(x, weight, bias, None, None, training, momentum, eps)[:3]


@register(aten._native_batch_norm_legit_no_training.default)
def _native_batch_norm_legit_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


@register(aten._batch_norm_no_update.default)
def _batch_norm_no_update(x, weight, bias, running_mean, running_var, momentum, eps):
    out = _batch_norm(x, weight, bias, running_mean, running_var, running_mean is None, momentum, eps)[:3]
    return (*out, jnp.zeros((0,), np.uint8))


@decomposition(aten._native_batch_norm_legit.default, aten.native_batch_norm.default)
def _batch_norm_update(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Batch norm that writes the new running statistics into ``running_mean`` / ``running_var``
    (native_batch_norm does so too, although its schema does not say it)."""
    if running_mean is None:
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)
    if not training:
        return aten._native_batch_norm_legit_no_training(x, weight, bias, running_mean, running_var, momentum, eps)
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional(
        x, weight, bias, running_mean, running_var, training, momentum, eps
    )
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd


@decomposition(aten._batch_norm_with_update.default)
def _batch_norm_with_update(x, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, rstd = _batch_norm_update(x, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, rstd, torch.empty((0,), dtype=torch.uint8, device=x.device)


@register(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    axes = (0,) + tuple(range(2, x.ndim))
    shape = _channel_shape(x)
    if train:
        mean, rstd = upcast(save_mean), upcast(save_invstd)
    else:
        mean, rstd = upcast(running_mean), jax.lax.rsqrt(upcast(running_var) + eps)
    mean, rstd = mean.reshape(shape), rstd.reshape(shape)
    g, xf = upcast(grad), upcast(x)
    xhat = (xf - mean) * rstd
    gx = None
    if output_mask[0]:
        gxhat = g * upcast(weight).reshape(shape) if weight is not None else g
        gx = _normalized_grad(gxhat, xhat, rstd, axes) if train else gxhat * rstd
        gx = gx.astype(x.dtype)
    param = weight if weight is not None else x
    gw = jnp.sum(g * xhat, axis=axes).astype(param.dtype) if output_mask[1] else None
    gb = jnp.sum(g, axis=axes).astype(param.dtype) if output_mask[2] else None
    return gx, gw, gb


@register(aten.batch_norm_backward.default)
def batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_var, update, eps, output_mask, reserve):
    return native_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_var, update, eps, output_mask)


# -- activations -------------------------------------------------------------------


refused_dtypes(aten.relu, kinds="bc")  # (torch's CPU relu is a clamp: no bools, no complex numbers)

# torch's CPU kernels of these activations are floating only (threshold and hardtanh compare: bools and complex
# numbers refused, hardtanh's clamp of uint8 too; silu computes complex numbers)
refused_dtypes(aten.elu, aten.celu, aten.gelu, aten.mish, aten.softplus, aten.leaky_relu, aten.hardsigmoid,
               aten.hardswish, aten.hardshrink, aten.softshrink, aten.log_sigmoid_forward, aten.glu, aten._prelu_kernel,
               aten._safe_softmax, kinds="bic")
refused_dtypes(aten.silu, kinds="bi")
refused_dtypes(aten.threshold, aten.hardtanh, aten.relu6, kinds="bc", dtypes=(torch.uint8,))

# (jnp.maximum propagates NaN, as torch's relu; its derivative at 0 would be 0.5)
_float_relu = torch_slopes(lambda x: jnp.maximum(x, jnp.zeros((), x.dtype)), lambda x: (x > 0,))


@register(aten.relu.default)
def relu(x):
    if x.dtype == np.bool_:
        return x
    return jnp.where(x > 0, x, jnp.zeros((), x.dtype)) if _dt.is_integral(x.dtype) else _float_relu(x)


def _gelu(x, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise RuntimeError("approximate argument must be either none or tanh.")
    return jax.nn.gelu(x, approximate=approximate == "tanh")


float_op(aten.gelu.default)(_gelu)
float_op(aten.gelu_backward.default)(_unary_backward(_gelu))


def _silu(x):
    return x * jax.nn.sigmoid(x)


float_op(aten.silu.default)(_silu)
float_op(aten.silu_backward.default)(_unary_backward(_silu))


def _mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


float_op(aten.mish.default)(_mish)
float_op(aten.mish_backward.default)(_unary_backward(_mish))


@float_op(aten.elu.default)
def elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    return jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * (alpha * scale))


@float_op(aten.elu_backward.default)
def elu_backward(grad, alpha, scale, input_scale, is_result, self_or_result):
    y = self_or_result
    if is_result:
        return jnp.where(y <= 0, grad * input_scale * (y + alpha * scale), grad * scale)
    return jnp.where(y <= 0, grad * input_scale * alpha * scale * jnp.exp(y * input_scale), grad * scale)


@float_op(aten.leaky_relu.default)
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@float_op(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad, x, negative_slope, self_is_result):
    return jnp.where(x > 0, grad, grad * negative_slope)


@register(aten.hardtanh.default)
def hardtanh(x, min_val=-1.0, max_val=1.0):
    if _dt.is_integral(x.dtype):
        return jnp.clip(x, math.ceil(min_val), math.floor(max_val)).astype(x.dtype)
    return _float_hardtanh(x, jnp.asarray(min_val, x.dtype), jnp.asarray(max_val, x.dtype))


# (torch's derivative is 0 at the bounds: relu6'(0) = relu6'(6) = 0)
_float_hardtanh = torch_slopes(lambda x, lo, hi: jnp.where(x < lo, lo, jnp.where(x > hi, hi, x)),
                               lambda x, lo, hi: ((x > lo) & (x < hi), None, None))


@float_op(aten.hardtanh_backward.default)
def hardtanh_backward(grad, x, min_val, max_val):
    return jnp.where((x <= min_val) | (x >= max_val), jnp.zeros((), grad.dtype), grad)


def _sixth(x):
    """``x / 6`` correctly rounded, as torch divides (XLA would multiply by a rounded 1/6)."""
    return true_divide(x, np.asarray(6, x.dtype))


@float_op(aten.hardsigmoid.default)
def hardsigmoid(x):
    return _hardsigmoid(x)


def _hardsigmoid_slope(x):
    # torch's kernel multiplies by 1/6 rounded to float32, float64 included
    return (jnp.where((x > -3) & (x < 3), np.asarray(np.float32(1 / 6), x.dtype), jnp.zeros((), x.dtype)),)


_hardsigmoid = torch_slopes(lambda x: _sixth(jnp.clip(x + 3, 0, 6)), _hardsigmoid_slope)


@float_op(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad, x):
    # (a where, not a product with the zero slope: torch's kernel gives 0 there for an inf or NaN gradient too)
    return jnp.where((x > -3) & (x < 3), grad * _hardsigmoid_slope(x)[0], jnp.zeros((), grad.dtype))


@float_op(aten.hardswish.default)
def hardswish(x):
    return _hardswish(x)


def _hardswish_slope(x):
    # at the kinks x = -3 and x = 3 torch takes the outer pieces' slopes, 0 and 1
    slope = true_divide(x, np.asarray(3, x.dtype)) + 0.5
    return (jnp.where(x <= -3, jnp.zeros((), x.dtype), jnp.where(x < 3, slope, jnp.ones((), x.dtype))),)


_hardswish = torch_slopes(lambda x: _sixth(x * jnp.clip(x + 3, 0, 6)), _hardswish_slope)


@float_op(aten.hardswish_backward.default)
def hardswish_backward(grad, x):
    return jnp.where(x <= -3, jnp.zeros((), grad.dtype), grad * _hardswish_slope(x)[0])


@float_op(aten.softplus.default)
def softplus(x, beta=1.0, threshold=20.0):
    # (jnp: a number an eager program takes as an input is traced, see dispatch._Compiled)
    return _softplus(x, jnp.asarray(beta, x.dtype), jnp.asarray(threshold, x.dtype))


def _softplus_slope(x, beta, threshold):
    # (a sigmoid, where torch's z / (z + 1) of z = exp(beta x) is inf / inf past the threshold, a NaN
    # that a where would pass on to reverse mode)
    return jnp.where(x * beta > threshold, jnp.ones((), x.dtype), jax.nn.sigmoid(x * beta)), None, None


def _softplus_value(x, beta, threshold):
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


_softplus = torch_slopes(_softplus_value, _softplus_slope)


@float_op(aten.softplus_backward.default)
def softplus_backward(grad, x, beta, threshold):
    return grad * _softplus_slope(x, beta, threshold)[0]


def _glu(x, dim=-1):
    a, b = jnp.split(x, 2, axis=canonical_dim(dim, x.ndim))
    return a * jax.nn.sigmoid(b)


@float_op(aten.glu.default)
def glu(x, dim=-1):
    d = canonical_dim(dim, x.ndim)
    if x.shape[d] % 2:
        raise RuntimeError(f"Halving dimension must be even, but dimension {d} is size {x.shape[d]}")
    return _glu(x, dim)


float_op(aten.glu_backward.default)(_unary_backward(_glu))


@float_op(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(x):
    return jax.nn.log_sigmoid(x), jnp.zeros((0,), x.dtype)


@float_op(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad, x, buffer):
    return grad * jax.nn.sigmoid(-x)


def _prelu(x, weight):
    return jnp.where(x > 0, x, weight * x)


float_op(aten._prelu_kernel.default)(_prelu)


@float_op(aten._prelu_kernel_backward.default)
def _prelu_kernel_backward(grad, x, weight):
    # the weight's gradient per element, as torch's kernel gives it (autograd sums it to the weight's shape)
    positive = x > 0
    return jnp.where(positive, grad, weight * grad), jnp.where(positive, jnp.zeros((), grad.dtype), x * grad)


@register(aten.threshold.default)
def threshold(x, threshold, value):
    checked_scalar(threshold, x.dtype)
    # compared in float32 for float16 / bfloat16, as torch's kernel does: the threshold is not rounded
    return jnp.where(upcast(x) <= threshold, np.asarray(checked_scalar(value, x.dtype)).astype(x.dtype), x)


@register(aten.threshold_backward.default)
def threshold_backward(grad, x, threshold):
    return jnp.where(upcast(x) <= threshold, jnp.zeros((), grad.dtype), grad)


@register(aten.hardshrink.default)
def hardshrink(x, lambd=0.5):
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros((), x.dtype), x)


@register(aten.hardshrink_backward.default)
def hardshrink_backward(grad, x, lambd):
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros((), grad.dtype), grad)


def _check_lambda(dtype, lambd):
    """torch's range for softshrink's lambda: [0, the largest value of the input's floating dtype]."""
    if not _dt.is_floating(dtype):
        raise NotImplementedError(f"\"softshrink_check\" not implemented for '{scalar_type_name(dtype)}'")
    top = float(jnp.finfo(dtype).max)
    if not 0 <= lambd <= top:  # (NaN too)
        raise RuntimeError(f"lambda must be in range [0, {top:g}] for input dtype {scalar_type_name(dtype)}, "
                           f"but found {lambd:g}")


@register(aten.softshrink.default)
def softshrink(x, lambd=0.5):
    _check_lambda(x.dtype, lambd)
    return _softshrink(x, lambd)


@upcasting
def _softshrink(x, lambd):
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, jnp.zeros((), x.dtype)))


@register(aten.softshrink_backward.default)
def softshrink_backward(grad, x, lambd):
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros((), grad.dtype), grad)


# -- losses ----------------------------------------------------------------------

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduce(loss, reduction):
    if reduction == _MEAN:
        return jnp.mean(loss)
    if reduction == _SUM:
        return jnp.sum(loss)
    return loss


def _loss_op(forward, backward_op, reduction_at=0):
    """Register ``forward(x, target, ...)`` elementwise loss and its backward ``(grad, x, target, ...)``;
    ``reduction_at``: where the reduction is among the arguments after ``target`` (None: the loss
    is not elementwise).

    torch's kernels broadcast ``grad`` against the input: a reduced loss's double backward
    passes one of the input's shape (the gradient of a loss of the gradient)."""

    def backward(grad, x, target, *args):
        if reduction_at is None or grad.ndim == 0 or len(args) <= reduction_at or args[reduction_at] == _NONE:
            return _vjp(lambda a: forward(a, target, *args), (x,), grad)[0]
        scale = 1 / x.size if args[reduction_at] == _MEAN else 1
        elementwise = (*args[:reduction_at], _NONE, *args[reduction_at + 1:])
        cotangent = (jnp.broadcast_to(grad, x.shape) * scale).astype(grad.dtype)
        return _vjp(lambda a: forward(a, target, *elementwise), (x,), cotangent)[0]

    float_op(backward_op)(backward)
    return forward


def _in_steps(x, dtype, *steps):
    """``x`` through ``steps`` in turn, each computed in float32 and rounded to ``dtype``:
    torch's CPU kernels that chain whole-tensor ops round a half result after each one."""
    for step in steps:
        x = step(upcast(x)).astype(dtype)
    return x


def _squared_error(x, target, reduction=_MEAN):
    return _reduce(jnp.square(x - target), reduction)


# torch's CPU loss kernels are floating only (the margin losses' targets are integers of their own: the input alone
# is looked at; their float16 / bfloat16, which CUDA's kernels compute, are computed); ctc_loss not of float16 /
# bfloat16 (nor on CUDA)
refused_dtypes(aten.mse_loss, aten.huber_loss, aten.smooth_l1_loss, aten.soft_margin_loss,
               aten.binary_cross_entropy_with_logits, kinds="bic")
refused_dtypes(aten.multi_margin_loss, aten.multilabel_margin_loss_forward, kinds="bic", operands=1)
refused_dtypes(aten._ctc_loss, dtypes=HALF_DTYPES)


@register(aten.mse_loss.default)
def mse_loss(x, target, reduction=_MEAN):
    loss = _in_steps(x, x.dtype, lambda v: v - upcast(target), jnp.square)
    return _reduce(upcast(loss), reduction).astype(x.dtype)


_loss_op(_squared_error, aten.mse_loss_backward.default)


@register(aten.soft_margin_loss.default)
def soft_margin_loss(x, target, reduction=_MEAN):
    """log1p(exp(-x * target)) as torch's kernel computes it: a half input can overflow
    to inf in exp where float32 would not."""
    loss = _in_steps(x, x.dtype, lambda v: -v * upcast(target), jnp.exp, jnp.log1p)
    return _reduce(upcast(loss), reduction).astype(x.dtype)


def _multilabel_margin(x, target, reduction):
    """(loss, is_target). A row's targets are its entries before the first -1 (torch's
    decomposition also counts the entries after it); each of them, repeats included,
    adds ``max(0, 1 - x[target] + x[i])`` over the classes i that are not targets."""
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    target = target.reshape(rows.shape).astype(np.int64)
    classes = rows.shape[-1]
    check_values(target, lambda t: (t < -1) | (t >= classes),
                 lambda _: TorchRuntimeError("argument #2 'target' is out of range"))
    listed = jnp.cumprod(target != -1, axis=-1).astype(bool)
    picked = jnp.where(listed, target, -1)
    is_target = (picked[:, :, None] == jnp.arange(classes)[None, None, :]).any(axis=1)
    at_target = jnp.take_along_axis(rows, jnp.clip(target, 0, classes - 1), axis=-1)
    z = 1 - at_target[:, :, None] + rows[:, None, :]
    hinge = jnp.where(z > 0, z, 0)  # (its gradient at 0 is 0, as torch's kernel counts z > 0 only)
    counted = listed[:, :, None] & ~is_target[:, None, :]
    loss = jnp.sum(jnp.where(counted, hinge, 0), axis=(1, 2)) / classes
    loss = _reduce(loss if x.ndim > 1 else loss.reshape(()), reduction)
    return loss, is_target.reshape(x.shape).astype(x.dtype)


@float_op(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(x, target, reduction=_MEAN):
    return _multilabel_margin(x, target, reduction)


@float_op(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    return _vjp(lambda a: _multilabel_margin(a, target, reduction)[0], (x,), grad)[0]


@float_op(aten.multi_margin_loss.default)
def multi_margin_loss(x, target, p=1, margin=1, weight=None, reduction=_MEAN):
    """Per row, ``max(0, margin - x[target] + x[i]) ** p`` (times ``weight[target]``) over the
    classes i other than the target, averaged over the classes."""
    if p not in (1, 2):
        raise RuntimeError("only p == 1 and p == 2 supported")
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    classes = rows.shape[-1]
    if target.ndim > 1 or target.size != rows.shape[0] or (x.ndim == 2 and target.ndim == 0):
        raise RuntimeError(
            "multi_margin_loss: target tensor should be 1-D with size equal to the number of input samples "
            f"(batch size). Expected target size [{rows.shape[0]}], but got {list(target.shape)}. Input has shape "
            f"{list(x.shape)}.")
    if weight is not None and weight.ndim != 1:
        raise RuntimeError("weight must be one-dimensional")
    if weight is not None and weight.shape[0] != classes:
        raise RuntimeError(f"inconsistent weight size, expected {classes} but got {list(weight.shape)}")
    target = target.reshape(-1).astype(np.int64)
    check_values(target, lambda t: (t < 0) | (t >= classes), lambda _: TorchRuntimeError("target out of range"))
    at_target = jnp.take_along_axis(rows, jnp.clip(target, 0, classes - 1)[:, None], axis=1)
    z = margin - at_target + rows
    h = jnp.where(z > 0, z if p == 1 else z * z, 0)
    if weight is not None:
        h = h * weight[target][:, None]
    h = jnp.where(jnp.arange(classes)[None, :] == target[:, None], 0, h)
    loss = jnp.sum(h, axis=1) / classes
    return _reduce(loss if x.ndim > 1 else loss.reshape(()), reduction)


_loss_op(multi_margin_loss.compute, aten.multi_margin_loss_backward.default, reduction_at=None)


@float_op(aten.smooth_l1_loss.default)
def smooth_l1_loss(x, target, reduction=_MEAN, beta=1.0):
    if beta < 0:
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")
    d = jnp.abs(x - target)
    if beta == 0:
        return _reduce(d, reduction)
    return _reduce(jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta), reduction)


_loss_op(smooth_l1_loss.compute, aten.smooth_l1_loss_backward.default)


@float_op(aten.huber_loss.default)
def huber_loss(x, target, reduction=_MEAN, delta=1.0):
    if delta <= 0:
        raise RuntimeError("huber_loss does not support non-positive values for delta.")
    d = jnp.abs(x - target)
    return _reduce(jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta)), reduction)


_loss_op(huber_loss.compute, aten.huber_loss_backward.default)


@jax.jit
def _in_unit_interval(x, target):
    """Whether every value of ``x`` and of ``target`` is in [0, 1] (NaN is not), as one
    compiled call: the check runs on every eager call."""
    return jnp.stack([jnp.all((x >= 0) & (x <= 1)), jnp.all((target >= 0) & (target <= 1))])


def _check_probabilities(x, target):
    """torch's CPU kernel checks every input and target value (see `check_values`)."""
    check_values(np.arange(2), lambda i: ~_in_unit_interval(x, target)[i], _outside_unit_interval)


def _outside_unit_interval(which):
    return TorchRuntimeError(f"all elements of {('input', 'target')[which]} should be between 0 and 1")


@register(aten.binary_cross_entropy.default)
def binary_cross_entropy(x, target, weight=None, reduction=_MEAN):
    if target.dtype != x.dtype or not _dt.is_floating(x.dtype):  # torch's dtype errors, from its kernel
        raise_as_torch(aten.binary_cross_entropy, stand_in(x.dtype), stand_in(target.dtype))
    _check_probabilities(x, target)
    return _binary_cross_entropy(x, target, weight, reduction)


def _bce_value(x, target):
    return -(target * jnp.maximum(jnp.log(x), -100.0) + (1 - target) * jnp.maximum(jnp.log1p(-x), -100.0))


def _bce_slopes(x, target):
    # torch's (`binary_cross_entropy_backward`): finite where x is 0 or 1 (JAX's derivative of the clamped logs
    # is NaN there: a saturated sigmoid's output), and log(1 - x) - log(x) unclamped for the target
    return (x - target) / jnp.maximum((1 - x) * x, 1e-12), jnp.log1p(-x) - jnp.log(x)


_bce = torch_slopes(_bce_value, _bce_slopes)


@upcasting
def _binary_cross_entropy(x, target, weight=None, reduction=_MEAN):
    loss = _bce(x, target)
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@float_op(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad, x, target, weight=None, reduction=_MEAN):
    """torch's formula, ``grad * (x - target) / max(x * (1 - x), 1e-12)``: finite where ``x``
    is 0 or 1, where the derivative of the forward's clamped logs is not."""
    out = grad * (x - target) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        out = out * weight
    out = jnp.broadcast_to(out, x.shape)
    return out / x.size if reduction == _MEAN else out


@float_op(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(x, target, weight=None, pos_weight=None, reduction=_MEAN):
    # (jax.nn.softplus is smooth at 0 for JAX's derivative too, log1p(exp(-|x|)) + max(-x, 0) not)
    softplus_neg = jax.nn.softplus(-x)
    if pos_weight is not None:
        loss = (1 - target) * x + ((pos_weight - 1) * target + 1) * softplus_neg
    else:
        loss = (1 - target) * x + softplus_neg
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


def _check_targets(target, n_classes, ignore_index):
    check_values(target, lambda t: (t != ignore_index) & ((t < 0) | (t >= n_classes)),
                 lambda t: IndexError(f"Target {t} is out of bounds."))


# nll_loss's argument checks, in torch's order and with its messages (a weight of the
# wrong size would otherwise be read with clamped indices, a float target be rounded).


def _check_nll_target_dtype(target):
    if target.dtype not in (_LONG, _BYTE):
        raise TorchRuntimeError(f"expected target dtype to be Long or Byte, but got {scalar_type_name(target.dtype)}")


def _check_nll_dtypes(op, x, weight, ndim):
    """torch's kernel's errors for an input that is not floating point or a weight of
    another dtype, from the kernel run on one-element stand-ins."""
    if _dt.is_floating(x.dtype) and (weight is None or weight.dtype == x.dtype):
        return
    ones = (1,) * ndim
    w = None if weight is None else torch.ones(1, dtype=_dt.to_torch(weight.dtype))
    raise_as_torch(op, torch.ones(ones, dtype=_dt.to_torch(x.dtype)), torch.zeros(ones[1:], dtype=torch.long), w,
                   _MEAN, -100)


def _check_nll(x, target, weight):
    if not 1 <= x.ndim <= 2:
        raise TorchRuntimeError("input tensor should be 1D or 2D")
    if target.ndim > 1:
        raise TorchRuntimeError("0D or 1D target tensor expected, multi-target not supported")
    _check_nll_target_dtype(target)
    if x.ndim == 1:
        if target.ndim == 1 and target.shape[0] != 1:
            raise TorchValueError(f"For 1D input, 1D target must have size 1, but got target size: {target.shape[0]}")
    elif target.ndim == 0:  # torch reads the target's size(0)
        raise IndexError("Dimension specified as 0 but tensor has no dimensions")
    elif x.shape[0] != target.shape[0]:
        raise TorchRuntimeError(f"size mismatch (got input: {list(x.shape)}, target: {list(target.shape)})")
    if weight is not None and weight.shape != (x.shape[-1],):
        raise TorchRuntimeError(f"weight tensor should be defined either for all {x.shape[-1]} classes or no classes "
                                f"but got weight tensor of shape: {list(weight.shape)}")
    _check_nll_dtypes(aten.nll_loss_forward, x, weight, 2)


def _check_nll2d(x, target, weight):
    if target.ndim != 3:
        raise TorchRuntimeError(f"only batches of spatial targets supported (3D tensors) but got targets of "
                                f"dimension: {target.ndim}")
    if x.ndim != 4:
        raise TorchRuntimeError(f"only batches of spatial inputs supported (4D tensors), but got input of "
                                f"dimension: {x.ndim}")
    _check_nll_target_dtype(target)
    if weight is not None and weight.size != x.shape[1]:
        raise TorchRuntimeError("weight tensor should be defined either for all or no classes")
    if target.shape != (x.shape[0],) + x.shape[2:]:
        # sic: torch's message has no closing parenthesis
        raise TorchRuntimeError(f"size mismatch (got input: {list(x.shape)} , target: {list(target.shape)}")
    _check_nll_dtypes(aten.nll_loss2d_forward, x, weight, 4)


def _nll_operands(x, target, weight):
    """(target, weight) as the lowerings read them: a 1-d input's target (one class, 0-d or
    of size 1) 0-d, the weight (nll_loss2d takes any shape of C elements) 1-d."""
    return target.reshape(()) if x.ndim == 1 else target, None if weight is None else weight.reshape(-1)


def _nll_parts(x, target, weight, ignore_index):
    """(per-element picked log-probability, per-element weight) of nll_loss, class dim 1 (0 if 1-d)."""
    cdim = 0 if x.ndim == 1 else 1
    _check_targets(target, x.shape[cdim], ignore_index)
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    picked = jnp.take_along_axis(x, jnp.expand_dims(safe, cdim), axis=cdim).squeeze(cdim)
    w = weight[safe] if weight is not None else jnp.ones((), x.dtype)
    w = jnp.where(keep, w, jnp.zeros((), x.dtype))
    return picked, w


@register(aten.nll_loss_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    _check_nll(x, target, weight)
    return _nll_loss(x, *_nll_operands(x, target, weight), reduction, ignore_index)


@register(aten.nll_loss2d_forward.default)
def nll_loss2d_forward(x, target, weight, reduction, ignore_index):
    _check_nll2d(x, target, weight)
    return _nll_loss(x, *_nll_operands(x, target, weight), reduction, ignore_index)


@upcasting
def _nll_loss(x, target, weight, reduction, ignore_index):
    picked, w = _nll_parts(x, target, weight, ignore_index)
    loss = -picked * w
    total = jnp.sum(jnp.broadcast_to(w, loss.shape))
    if reduction == _NONE:
        return loss, jnp.zeros((), x.dtype)
    if reduction == _SUM:
        return jnp.sum(loss), total
    # a batch whose every target is ignored: NaN (0 / 0) as torch's, with torch's zero gradient (JAX's
    # derivative of the quotient would be 0 / 0 too)
    nothing = total == 0
    return jnp.where(nothing, jnp.nan, jnp.sum(loss) / jnp.where(nothing, 1, total)).astype(loss.dtype), total


@float_op(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    cdim = 0 if x.ndim == 1 else 1
    target, weight = _nll_operands(x, target, weight)
    _, w = _nll_parts(x, target, weight, ignore_index)
    scale = -w * grad
    if reduction == _MEAN:
        scale = scale / total_weight
    # torch writes no gradient for an ignored target: 0 (not -0, nor 0 / 0 where every target is ignored)
    scale = jnp.where(target != ignore_index, scale, 0)
    onehot = jax.nn.one_hot(jnp.where(target != ignore_index, target, 0), x.shape[cdim], dtype=x.dtype, axis=cdim)
    return onehot * jnp.expand_dims(jnp.broadcast_to(scale, target.shape), cdim)


# -- one_hot ---------------------------------------------------------------------------
#
# aten::one_hot is CompositeImplicitAutograd, and for a tensor subclass torch's C++ kernel
# takes its traceable form (compare with arange), which checks no class value: a negative
# one, or one not below num_classes, gives a row of zeros where the CPU kernel raises.
# (Its Python decomposition checks them with _assert_async, a host round trip per call.)
# The AutogradPrivateUse1 kernel adds the CPU kernel's checks in eager mode.


def one_hot_autograd(x, num_classes=-1):
    """The AutogradPrivateUse1 kernel of aten::one_hot."""
    if x.numel() == 0 and num_classes <= 0:  # the C++ kernel would take the max of no values
        raise RuntimeError("Can not infer total number of classes from empty tensor.")
    if num_classes == -1 and is_traced(x):
        raise OpError("torch2jax: aten.one_hot with num_classes=-1 has an output shape that depends on tensor values, "
                      "so it cannot run under jax.jit; pass num_classes")
    if x.dtype == torch.long and x.numel():
        with jax.enable_x64(True):  # (int64 values: JAX's 64-bit types are on only inside dispatch)
            check_values(x.jax(), lambda v: v < 0, lambda _: RuntimeError("Class values must be non-negative."))
            if num_classes != -1:
                check_values(x.jax(), lambda v: v >= num_classes,
                             lambda _: RuntimeError("Class values must be smaller than num_classes."))
    return aten.one_hot.default._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, x, num_classes)


_library = torch.library.Library("aten", "IMPL")
_library.impl("one_hot", one_hot_autograd, "AutogradPrivateUse1")


# -- pixel shuffle -----------------------------------------------------------------------
#
# torch's decompositions of pixel_shuffle / pixel_unshuffle check no more than the rank, so
# a size that does not divide fails in their view with a message about the view; these run
# them after the CPU kernels' checks.


def _check_pixel_shuffle(name, x, factor, kind):
    if x.dim() < 3:
        raise TorchRuntimeError(f"{name} expects input to have at least 3 dimensions, but got input with {x.dim()} "
                                f"dimension(s)")
    if factor <= 0:
        raise TorchRuntimeError(f"{name} expects a positive {kind}_factor, but got {factor}")


@decomposition(aten.pixel_shuffle.default)
def pixel_shuffle(x, upscale_factor):
    _check_pixel_shuffle("pixel_shuffle", x, upscale_factor, "upscale")
    c, square = x.shape[-3], upscale_factor * upscale_factor
    if c % square:
        raise TorchRuntimeError(f"pixel_shuffle expects its input's 'channel' dimension to be divisible by the square "
                                f"of upscale_factor, but input.size(-3)={c} is not divisible by {square}")
    return _TORCH_DECOMPOSITIONS[aten.pixel_shuffle.default](x, upscale_factor)


@decomposition(aten.pixel_unshuffle.default)
def pixel_unshuffle(x, downscale_factor):
    _check_pixel_shuffle("pixel_unshuffle", x, downscale_factor, "downscale")
    for dim, name in ((-2, "height"), (-1, "width")):
        if x.shape[dim] % downscale_factor:
            raise TorchRuntimeError(f"pixel_unshuffle expects {name} to be divisible by downscale_factor, but "
                                    f"input.size({dim})={x.shape[dim]} is not divisible by {downscale_factor}")
    return _TORCH_DECOMPOSITIONS[aten.pixel_unshuffle.default](x, downscale_factor)


@decomposition(aten.channel_shuffle.default)
def channel_shuffle(x, groups):
    """torch's decomposition, laid out as torch's CPU kernel lays the result out: as the input
    (channels_last stays so)."""
    out = _TORCH_DECOMPOSITIONS[aten.channel_shuffle.default](x, groups)
    return out.contiguous(memory_format=torch._prims_common.suggest_memory_format(x))


def native_channel_shuffle(x, groups):
    """The AutogradPrivateUse1 kernel of aten::native_channel_shuffle: `channel_shuffle`, as torch's
    CPU kernel is the same for both (its composite kernel views the input, which fails for a
    transposed one, and lays a channels_last input's result out contiguously)."""
    return aten.channel_shuffle.default(x, groups)


_library.impl("native_channel_shuffle", native_channel_shuffle, "AutogradPrivateUse1")


# -- max_unpool -------------------------------------------------------------------------
#
# torch's decompositions scatter into the output with the indices unchecked; JAX drops an
# out-of-range update where torch's kernels raise.


refused_dtypes(aten.max_unpool2d, aten.max_unpool3d, kinds="bic", operands=1)  # (floating kernels; int64 indices)


@decomposition(aten.max_unpool2d.default, aten.max_unpool3d.default)
def max_unpool(x, indices, output_size, *args):
    op = aten.max_unpool2d.default if len(output_size) == 2 else aten.max_unpool3d.default
    if isinstance(indices, torch.Tensor) and indices.device.type == "jax":
        size = math.prod(output_size)
        check_values(indices.jax(), lambda i: (i < 0) | (i >= size), lambda i: TorchRuntimeError(
            f"Found an invalid max index: {i} (output volumes are of size {'x'.join(map(str, output_size))})"))
    out = _TORCH_DECOMPOSITIONS[op](x, indices, output_size, *args)
    # torch's CPU kernels lay the result out as the input (channels_last stays so)
    return out.contiguous(memory_format=torch._prims_common.suggest_memory_format(x))


# -- embedding bag -----------------------------------------------------------------------


refused_dtypes(aten._embedding_bag, aten._embedding_bag_forward_only, kinds="bic", operands=1)  # (floating weights)


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """(output, offset2bag, bag_size, max_indices) as torch's CPU kernel gives them, which
    its backward reads. Bag b starts at offsets[b]; the last bag runs to the end of
    ``indices``, or with include_last_offset to the last offset: the entries after it
    belong to no bag (offset2bag says ``bags``), as torch's default (float32 sum) kernel
    and CSR read them (its other kernels add them to the last bag, or count them in a
    mean's divisor only). Entries equal to padding_idx count nowhere."""
    num_weights = weight.shape[0]
    check_values(indices, lambda i: (i < 0) | (i >= num_weights), lambda k, i: TorchRuntimeError(
        f"Index {k} of input takes value {i} which is not in the valid range [0, {num_weights})"), with_position=True)
    n = indices.shape[0]
    _check_bag_offsets(offsets, n)
    bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    offset2bag = jnp.searchsorted(offsets, jnp.arange(n), side="right").astype(np.int64) - 1
    valid = _in_bag(indices, offset2bag, bags, padding_idx)
    rows = upcast(weight)[indices]
    if per_sample_weights is not None:
        rows = rows * upcast(per_sample_weights)[:, None]
    count = jax.ops.segment_sum(valid.astype(np.int64), offset2bag, bags)
    if mode == 2:
        masked = jnp.where(valid[:, None], rows, -jnp.inf)
        best = jax.ops.segment_max(masked, offset2bag, bags)
        first = jax.ops.segment_min(jnp.where(masked == best[offset2bag], jnp.arange(n)[:, None], n), offset2bag, bags)
        out = jnp.where(count[:, None] > 0, best, 0)
        # (no indices at all: every bag is empty, and there is no entry to read)
        picked = indices[jnp.minimum(first, n - 1)] if n else jnp.zeros(first.shape, indices.dtype)
        max_indices = jnp.where(count[:, None] > 0, picked, 0).astype(np.int64)
        return out.astype(weight.dtype), offset2bag, count, max_indices
    out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), offset2bag, bags)
    if mode == 1:
        out = out / jnp.maximum(count, 1)[:, None]
    bag_size = count if mode == 1 else jnp.zeros(bags, np.int64)
    return out.astype(weight.dtype), offset2bag, bag_size, bag_size


def _check_bag_offsets(offsets, n):
    """torch's checks of embedding_bag's ``offsets`` (bag starts into ``n`` indices)."""
    if offsets.shape[0] == 0:
        return
    check_values(offsets[:1], lambda o: o != 0, lambda o: TorchRuntimeError(
        "offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start from position 0. "
        f"However, got {o}"))
    check_values(offsets[-1:], lambda o: o > n, lambda o: TorchRuntimeError(
        f"offsets[-1] can not be greater than input's length {n} but got offsets[-1] of {o}"))
    check_values(offsets[1:] - offsets[:-1], lambda d: d < 0, lambda d: TorchRuntimeError(
        "embedding_bag: offsets must be non-decreasing (each bag starts where the previous one ends or later)"))


def _in_bag(indices, offset2bag, bags, padding_idx):
    """Which entries of ``indices`` count: those in a bag, other than padding_idx."""
    valid = offset2bag < bags
    return valid & (indices != padding_idx) if padding_idx >= 0 else valid


@register(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                  scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    """The weight's gradient: each entry of ``indices`` gets its bag's gradient (over the
    bag's size for mean, times its per-sample weight), an entry equal to ``padding_idx``
    none; for max, each (bag, column) goes to the row that was the maximum. With
    ``scale_grad_by_freq`` a row's gradient is divided by how often it occurs in ``indices``."""
    g = upcast(grad)
    out = jnp.zeros((num_weights, grad.shape[-1]), g.dtype)
    if mode == 2:
        rows = jnp.where(bag_size[:, None] > 0, maximum_indices, num_weights)  # empty bags add nowhere
        cols = jnp.broadcast_to(jnp.arange(grad.shape[-1]), rows.shape)
        out = out.at[rows, cols].add(g, mode="drop")
    else:
        per_entry = g[offset2bag]
        if mode == 1:
            per_entry = per_entry / jnp.maximum(bag_size[offset2bag], 1)[:, None]
        if per_sample_weights is not None:
            per_entry = per_entry * upcast(per_sample_weights)[:, None]
        valid = _in_bag(indices, offset2bag, grad.shape[0], padding_idx)
        out = out.at[jnp.where(valid, indices, num_weights)].add(per_entry, mode="drop")
    if scale_grad_by_freq:
        out = out / _embedding_bag_freq(indices, num_weights)[:, None]
    return out.astype(grad.dtype)


def _embedding_bag_freq(indices, num_weights):
    """The divisor of each weight row under ``scale_grad_by_freq``, as torch's CPU kernel
    computes it. That kernel walks the sorted indices in groups of equal values and scales
    the i-th group by the count of ``sorted[i]`` (the i-th sorted entry, not the group's
    value), so a row is divided by its own frequency only while the groups before it are
    single entries. F.embedding divides by the row's own frequency."""
    if indices.shape[0] == 0:
        return jnp.ones(num_weights, _F32)
    counts = jnp.zeros(num_weights, np.int64).at[indices].add(1)
    group = jnp.cumsum(counts > 0) - 1  # each present row's group number among the sorted values
    divisor = counts[jnp.sort(indices)[jnp.clip(group, 0, indices.shape[0] - 1)]]
    return jnp.maximum(divisor, 1).astype(_F32)


@decomposition(aten._embedding_bag_backward)
def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                            scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    """The weight gradient of ``EmbeddingBag``: sparse for ``sparse=True``, as torch's (torch2jax/ops/sparse.py:
    stored dense inside a traced program)."""
    if sparse:
        return aten._embedding_bag_sparse_backward(grad, indices, offsets, offset2bag, bag_size, num_weights,
                                                   scale_grad_by_freq, mode, per_sample_weights, padding_idx)
    return aten._embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                              scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@register(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    """d out / d per_sample_weights (sum mode): each entry's row dotted with its bag's gradient."""
    dots = jnp.sum(upcast(grad)[offset2bag] * upcast(weight)[indices], axis=-1)
    dots = jnp.where(_in_bag(indices, offset2bag, grad.shape[0], padding_idx), dots, 0)
    return dots.astype(grad.dtype)


# -- weight norm -------------------------------------------------------------------------
#
# The forward (`_weight_norm_interface`) goes through torch's decomposition; its fused
# backward has none.


def _weight_norm(v, g, dim):
    axes = tuple(i for i in range(v.ndim) if i != dim)
    return v * (g / jnp.sqrt(jnp.sum(v * v, axis=axes, keepdims=True)))


@float_op(aten._weight_norm_interface_backward.default)
def _weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    return _vjp(lambda v, g: _weight_norm(v, g, dim), (saved_v, saved_g), grad_w)


# -- dropout -------------------------------------------------------------------------


@register(aten.native_dropout.default)
def native_dropout(x, p, train):
    if train is False or p == 0:
        return x, jnp.ones(x.shape, np.bool_)
    if p == 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, np.bool_)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        # torch's CPU kernel scales an integer tensor in place by 1 / (1 - p)
        raise RuntimeError(f"result type Float can't be cast to the desired output type {scalar_type_name(x.dtype)}")
    mask = jax.random.bernoulli(_env.next_key(), np.float32(1 - p), x.shape)
    return (upcast(x) * mask * (1 / (1 - p))).astype(x.dtype), mask


@register(aten.native_dropout_backward.default)
def native_dropout_backward(grad, mask, scale):
    dtype = _dt.result_type(grad, mask, scale)
    return (upcast(grad.astype(dtype)) * mask * scale).astype(dtype)


# -- recurrent cells ---------------------------------------------------------------------
#
# On a PrivateUse1 device nn.LSTM / nn.GRU (CompositeImplicit `aten::lstm` / `aten::gru`)
# compute the gate matmuls themselves and hand the elementwise part of each step to these
# fused cells, as on CUDA. The workspace is private to a forward/backward pair: here the
# LSTM's is its activated gates (i, f, g, o); the GRU's is (r, z, n, hx, hn) with hn the
# hidden part of the candidate gate before the reset gate scales it.


def _sum_batch(g):
    return g.sum(axis=tuple(range(g.ndim - 1)))


@float_op(aten._thnn_fused_lstm_cell.default)
def _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    return o * jnp.tanh(cy), cy, jnp.concatenate([i, f, g, o], axis=-1)


@register(aten._thnn_fused_lstm_cell_backward_impl.default)
def _thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    dtype = workspace.dtype
    i, f, g, o = jnp.split(upcast(workspace), 4, axis=-1)
    cx, cy = upcast(cx), upcast(cy)
    tanh_cy = jnp.tanh(cy)
    grad_hy = jnp.zeros_like(cy) if grad_hy is None else upcast(grad_hy)
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + upcast(grad_cy)
    grad_gates = jnp.concatenate(
        [grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f), grad_c * i * (1 - g * g), grad_hy * tanh_cy * o * (1 - o)],
        axis=-1,
    )
    grad_bias = _sum_batch(grad_gates).astype(dtype) if has_bias else None
    return grad_gates.astype(dtype), (grad_c * f).astype(dtype), grad_bias


@float_op(aten._thnn_fused_gru_cell.default)
def _thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    ir, iz, i_n = jnp.split(input_gates, 3, axis=-1)
    hr, hz, hn = jnp.split(hidden_gates, 3, axis=-1)
    r, z = jax.nn.sigmoid(ir + hr), jax.nn.sigmoid(iz + hz)
    n = jnp.tanh(i_n + r * hn)
    return n + z * (hx - n), jnp.concatenate([r, z, n, hx, hn], axis=-1)


@register(aten._thnn_fused_gru_cell_backward.default)
def _thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    dtype = workspace.dtype
    r, z, n, hx, hn = jnp.split(upcast(workspace), 5, axis=-1)
    grad_hy = upcast(grad_hy)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_n * hn * r * (1 - r)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_input = jnp.concatenate([grad_r, grad_z, grad_n], axis=-1).astype(dtype)
    grad_hidden = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=-1).astype(dtype)
    biases = (_sum_batch(grad_input), _sum_batch(grad_hidden)) if has_bias else (None, None)
    return grad_input, grad_hidden, (grad_hy * z).astype(dtype), *biases


@register(aten._pack_padded_sequence.default)
def _pack_padded_sequence(x, lengths, batch_first):
    """PackedSequence data of ``x``; its batch_sizes stay a CPU tensor, as torch requires."""
    try:
        lengths = np.asarray(lengths)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        raise OpError("torch2jax: _pack_padded_sequence: lengths must be concrete (a CPU tensor), not traced") from None
    if lengths.ndim != 1 or lengths.shape[0] != x.shape[0 if batch_first else 1]:
        raise OpError(f"torch2jax: _pack_padded_sequence: expected {x.shape[0 if batch_first else 1]} lengths, got "
                           f"shape {lengths.shape}")
    if lengths.size and lengths.min() <= 0:
        raise TorchRuntimeError("Length of all samples has to be greater than 0, but found an element in 'lengths' "
                                "that is <= 0")
    if np.any(np.diff(lengths) > 0):
        raise TorchRuntimeError(
            "`lengths` array must be sorted in decreasing order when `enforce_sorted` is True. You can pass "
            "`enforce_sorted=False` to pack_padded_sequence and/or pack_sequence to sidestep this requirement if you "
            "do not need ONNX exportability.")
    if lengths.size and lengths[0] > x.shape[1 if batch_first else 0]:
        # (torch's CPU kernel reads past the end of the input here)
        raise OpError(f"torch2jax: _pack_padded_sequence: a length of {lengths[0]} exceeds the sequence length "
                      f"{x.shape[1 if batch_first else 0]}")
    if batch_first:
        x = jnp.swapaxes(x, 0, 1)
    batch_sizes = (lengths[None, :] > np.arange(lengths[0] if lengths.size else 0)[:, None]).sum(axis=1)
    rows = np.concatenate([t * x.shape[1] + np.arange(n) for t, n in enumerate(batch_sizes)] or [np.zeros(0, int)])
    data = x.reshape(-1, *x.shape[2:])[rows]
    return data, torch.from_numpy(batch_sizes.astype(np.int64))


# -- grouped matmul ----------------------------------------------------------------------
#
# F.grouped_mm (aten::_grouped_mm) is the expert kernel of HF mixture-of-experts layers:
# one matmul per group, the groups of a 2D operand being consecutive slices ending at
# `offs`. Its derivative is _grouped_mm again, so the 2D x 2D case (a ragged contraction)
# is the weight gradient of the 2D x 3D forward.


def _check_grouped_mm(a, b, offs, bias, out_dtype):
    if a.ndim not in (2, 3) or b.ndim not in (2, 3):
        raise OpError(f"torch2jax: _grouped_mm: operands must be 2D or 3D, got {a.ndim}D and {b.ndim}D")
    if a.dtype != b.dtype:
        raise OpError(f"torch2jax: _grouped_mm: operands must have the same dtype, got {a.dtype} and {b.dtype}")
    if (offs is None) != (a.ndim == 3 and b.ndim == 3):
        raise OpError("torch2jax: _grouped_mm: offs is required with a 2D operand and not allowed with two 3D operands")
    if offs is not None and (offs.ndim != 1 or offs.dtype != np.int32):
        raise OpError(f"torch2jax: _grouped_mm: offs must be a 1D int32 tensor, got {offs.ndim}D {offs.dtype}")
    if bias is not None:
        raise OpError("torch2jax: _grouped_mm: bias is not supported")
    if out_dtype is not None and _dt.to_jax(out_dtype) != a.dtype:
        raise OpError(f"torch2jax: _grouped_mm: out_dtype must be the operands' dtype {a.dtype}, got {out_dtype}")


@register(aten._grouped_mm.default)
def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    _check_grouped_mm(a, b, offs, bias, out_dtype)
    kwargs = dict(precision=_precision(), preferred_element_type=_acc_dtype(a.dtype))
    if offs is None:
        out = lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))), **kwargs)
    else:
        sizes = jnp.diff(offs, prepend=jnp.zeros((1,), offs.dtype))
        if a.ndim == 2 and b.ndim == 3:  # rows of `a` in groups, one matrix of `b` per group
            out = lax.ragged_dot(a, b, sizes, **kwargs)
        elif a.ndim == 3:  # columns of `b` in groups, one matrix of `a` per group
            out = lax.ragged_dot(b.T, jnp.swapaxes(a, 1, 2), sizes, **kwargs).T
        else:  # the contracted dimension in groups: one output matrix per group
            numbers = lax.RaggedDotDimensionNumbers((((1,), (0,)), ((), ())), [1], [])
            out = lax.ragged_dot_general(a, b, sizes, numbers, **kwargs)
    return out.astype(a.dtype)


# -- attention -------------------------------------------------------------------------
#
# F.scaled_dot_product_attention is CompositeImplicitAutograd: on a backend without a
# fused kernel it splits into ~15 ATen ops (the "math" path) before reaching
# __torch_dispatch__. A kernel for the AutogradPrivateUse1 key sends it instead to
# `_scaled_dot_product_fused_attention_overrideable`, the op torch reserves for
# out-of-tree backends; its derivative is `..._overrideable_backward`, so autograd
# stays torch's and both ops get one lowering each.


def _scores(q, k, v, bias, is_causal, scale):
    """(scores, keys, values, scale) of attention in float32 for half inputs, the key and value
    heads repeated for grouped-query attention."""
    k, v = upcast(k), upcast(v)
    if k.shape[-3] != q.shape[-3]:
        k = jnp.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
        v = jnp.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    if scale is None:  # torch's 1 / sqrt(E), inf for E = 0, where it scales empty queries and keys
        scale = 1 / math.sqrt(q.shape[-1]) if q.shape[-1] else math.inf
    s = jnp.einsum("...qd,...kd->...qk", upcast(q), k)
    if q.shape[-1]:  # (an empty product is 0, and stays 0 in torch, which scales q and k, not their product)
        s = s * scale
    if is_causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)  # (jnp: sizes may be symbolic)
    if bias is not None:
        s = s + upcast(bias)
    return s, k, v, scale


def _attention(q, k, v, bias, dropout_p, is_causal, scale, key):
    """(output, logsumexp) of attention computed in float32 for half inputs."""
    s, _, v, _ = _scores(q, k, v, bias, is_causal, scale)
    p = _safe_softmax_compute(s, axis=-1)
    if dropout_p > 0:
        p = p * jax.random.bernoulli(key, np.float32(1 - dropout_p), p.shape) / (1 - dropout_p)
    out = jnp.einsum("...qk,...kd->...qd", p, v).astype(q.dtype)
    return out, jax.nn.logsumexp(s, axis=-1)


@functools.partial(jax.jit, static_argnames=("dropout_p", "is_causal", "scale"))
def _attention_program(q, k, v, bias, key, dropout_p, is_causal, scale):
    """`_attention` and the seed its backward gets, as one compiled program. The fused op returns
    sizes besides tensors, so dispatch runs it op by op (`dispatch._jittable`), where each of its
    primitives would compile on its own for every new sequence length (eager generation)."""
    key = jax.random.key(0) if key is None else key
    out, lse = _attention(q, k, v, bias, dropout_p, is_causal, scale, key)
    return out, lse, jax.random.key_data(key).astype(np.int64)


@register(aten._scaled_dot_product_fused_attention_overrideable.default)
def _sdpa_overrideable(q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                       scale=None):
    key = _env.next_key() if dropout_p > 0 else None
    out, lse, seed = _attention_program(q, k, v, attn_bias, key, dropout_p=float(dropout_p), is_causal=bool(is_causal),
                                        scale=None if scale is None else float(scale))
    empty = jnp.zeros((0,), np.int64)
    return out, lse, empty, empty, q.shape[-2], k.shape[-2], seed, empty, jnp.zeros((0,), q.dtype)


def _flash_attention_grads(grad, q, k, v, bias, is_causal, scale, out, lse):
    """(dq, dk, dv) as torch's CPU flash kernel computes them: the probabilities again from the
    forward's logsumexp, ``exp(s - lse)``. A row whose scores are all about ``finfo.min``
    (a padded query under an additive mask) has an lse that rounds to its maximum, so each of
    its probabilities comes back as 1 rather than 1/n: torch's gradients there, which autodiff
    of the softmax would not give."""
    groups = q.shape[-3] // k.shape[-3]
    s, kf, vf, scale = _scores(q, k, v, bias, is_causal, scale)
    qf, gf = upcast(q), upcast(grad)
    lse = lse[..., None]
    p = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(s - lse))  # (a row masked out entirely has none)
    dp = jnp.einsum("...qd,...kd->...qk", gf, vf)
    ds = p * (dp - jnp.sum(gf * upcast(out), axis=-1, keepdims=True))
    dq = jnp.einsum("...qk,...kd->...qd", ds, kf) * scale
    dk = jnp.einsum("...qk,...qd->...kd", ds, qf) * scale
    dv = jnp.einsum("...qk,...qd->...kd", p, gf)
    if groups > 1:  # each key / value head's gradient sums over the query heads sharing it
        dk = dk.reshape(*dk.shape[:-3], k.shape[-3], groups, *dk.shape[-2:]).sum(-3)
        dv = dv.reshape(*dv.shape[:-3], v.shape[-3], groups, *dv.shape[-2:]).sum(-3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@register(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def _sdpa_overrideable_backward(grad, q, k, v, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q, cum_seq_k,
                                max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if dropout_p == 0 and q.ndim == 4 and not (len(grad_input_mask) > 3 and grad_input_mask[3]):
        # where torch's CPU backend takes its flash kernel
        grads = _flash_attention_grads(grad, q, k, v, attn_bias, is_causal, scale, out, logsumexp)
        return tuple(g if wanted else None for g, wanted in zip(grads, grad_input_mask)) + (None,)
    key = jax.random.wrap_key_data(philox_seed.astype(np.uint32))
    primals = (q, k, v) + ((attn_bias,) if attn_bias is not None else ())

    def forward(*args):
        bias = args[3] if attn_bias is not None else None
        return _attention(args[0], args[1], args[2], bias, dropout_p, is_causal, scale, key)[0]

    grads = _vjp(forward, primals, grad)
    result = [g if wanted else None for g, wanted in zip(grads, grad_input_mask)]
    return tuple(result) + (None,) * (4 - len(result))


def _flash_on_cpu(q, k, v, attn_mask, dropout_p) -> bool:
    """Whether torch's CPU backend would take its flash kernel, which applies a mask and
    ``is_causal`` together, where its math kernel refuses them together."""
    return (q.dim() == 4 and dropout_p == 0 and not attn_mask.requires_grad
            and k.shape[-3] == q.shape[-3] and all(t.stride(-1) == 1 for t in (q, k, v)))


def _math_path(q, k, v) -> bool:
    """Whether attention takes torch's math path (its ATen ops, differentiable any number of
    times, batched by vmap, with forward-mode derivatives) rather than the fused op: where
    torch's CPU backend takes it (inputs that are not 4-D), where ``sdpa_kernel`` asks for it,
    and under torch.func transforms and forward-mode AD, which the fused op's derivative does
    not support."""
    if q.dim() != 4 or not torch._C._get_overrideable_sdp_enabled():
        return True
    if torch._C._functorch.maybe_current_level() is not None:
        return True
    return torch.autograd.forward_ad._current_level >= 0 and any(
        torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in (q, k, v))


def _check_attention_inputs(q, k, v, attn_mask):
    """torch's checks of scaled_dot_product_attention's arguments, with its messages, then
    the sizes its kernels assume: the query's and key's feature sizes (the scores are their
    dot products) and the key's and value's lengths (torch's CPU kernels read past a shorter
    value)."""
    if not q.dtype == k.dtype == v.dtype:
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got query.dtype: "
                           f"{_dt.c_type_name(q.dtype)} key.dtype: {_dt.c_type_name(k.dtype)} and value.dtype: "
                           f"{_dt.c_type_name(v.dtype)} instead.")
    if min(q.dim(), k.dim(), v.dim()) < 2:
        raise RuntimeError(f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
                           f"{q.dim()} key.dim: {k.dim()} and value.dim: {v.dim()} instead.")
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
        raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                           f"attn_mask.dtype: {_dt.c_type_name(attn_mask.dtype)} and  query.dtype: "
                           f"{_dt.c_type_name(q.dtype)} instead.")
    if not (q.dtype.is_floating_point or q.dtype.is_complex):
        raise RuntimeError(f"expected scalar type Float but found {scalar_type_name(q.dtype)}")
    if q.dtype.is_complex:
        raise NotImplementedError(f'"softmax_lastdim_kernel_impl" not implemented for \'{scalar_type_name(q.dtype)}\'')
    if q.shape[-1] != k.shape[-1]:
        raise RuntimeError(f"scaled_dot_product_attention: query {list(q.shape)} and key {list(k.shape)} must have "
                           "the same last dimension (the attention scores are their dot products)")
    if k.shape[-2] != v.shape[-2]:
        raise RuntimeError(f"scaled_dot_product_attention: key {list(k.shape)} and value {list(v.shape)} must have "
                           "the same length (dimension -2): each value row belongs to one key")
    if attn_mask is not None:  # (the scores' shape, with TensorIterator's message)
        broadcast_shapes((*q.shape[:-1], k.shape[-2]), tuple(attn_mask.shape))


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """The AutogradPrivateUse1 kernel of aten::scaled_dot_product_attention."""
    _check_attention_inputs(q, k, v, attn_mask)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # (True: attend) an additive mask, as torch makes one before either path
        attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=q.dtype, device=q.device),
                                torch.scalar_tensor(float("-inf"), dtype=q.dtype, device=q.device))
    if _math_path(q, k, v):
        return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                       enable_gqa=enable_gqa)[0]
    if attn_mask is not None and is_causal and not _flash_on_cpu(q, k, v, attn_mask, dropout_p):
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    grouped = k.dim() >= 3 and k.shape[-3] != q.shape[-3] and enable_gqa and q.shape[-3] % k.shape[-3] == 0
    if not grouped and not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        # torch broadcasts the batch and head dimensions (one key / value head for all query heads:
        # multi-query attention, as Falcon calls it), on its math path: its gradients for a row
        # masked with finfo.min (a left-padded query) are the softmax's, not the flash kernel's
        try:
            torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        except RuntimeError:
            raise RuntimeError(
                f"scaled_dot_product_attention: query, key and value have batch and head dimensions "
                f"{list(q.shape[:-2])}, {list(k.shape[:-2])} and {list(v.shape[:-2])}, which do not broadcast; "
                f"pass enable_gqa=True for grouped-query attention"
            ) from None
        return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)[0]
    return aten._scaled_dot_product_fused_attention_overrideable(
        q, k, v, attn_mask, dropout_p, is_causal, False, scale=scale
    )[0]


_library.impl("scaled_dot_product_attention", scaled_dot_product_attention, "AutogradPrivateUse1")


# -- transformer inference fast path ----------------------------------------------------
#
# In eval mode without grad, nn.MultiheadAttention (self-attention, batch_first) and
# nn.TransformerEncoderLayer call these fused kernels instead of their Python forward.
# Their masks are "masked out" flags (any nonzero float counts as masked, as in torch's
# kernels): mask_type 0 is (L, S), 1 a key padding mask (B, S), 2 a merged (B, H, L, S).


def _dense(x, weight, bias):
    return jnp.matmul(x, weight.T, precision=_precision()) + bias


def _fast_path_attention(q, k, v, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type):
    """(output, per-head attention weights); a fully masked row gives NaN, as in torch."""
    if not q.shape == k.shape == v.shape:
        raise OpError(f"torch2jax: _native_multi_head_attention: expected query/key/value shapes to match, got "
                      f"{q.shape}, {k.shape}, {v.shape}")

    def heads(x, weight, bias):
        y = _dense(x, weight, bias)
        return y.reshape(*y.shape[:-1], num_heads, -1).swapaxes(-2, -3)

    weights, biases = jnp.split(qkv_weight, 3), jnp.split(qkv_bias, 3)
    qh, kh, vh = (heads(x, w, b) for x, w, b in zip((q, k, v), weights, biases))
    s = jnp.einsum("...qd,...kd->...qk", qh, kh, precision=_precision()) / math.sqrt(qh.shape[-1])
    if mask is not None:
        masked = mask if mask.dtype == np.bool_ else mask != 0
        s = jnp.where(masked[:, None, None, :] if mask_type == 1 else masked, -jnp.inf, s)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("...qk,...kd->...qd", p, vh, precision=_precision()).swapaxes(-2, -3)
    return _dense(out.reshape(q.shape), proj_weight, proj_bias), p


@float_op(aten._native_multi_head_attention.default)
def _native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                 mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    out, p = _fast_path_attention(query, key, value, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                                  mask_type)
    if not need_weights:
        return out, None
    return out, p.mean(axis=-3) if average_attn_weights else p


@float_op(aten._transformer_encoder_layer_fwd.default)
def _transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                                   norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                                   ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    def attention(x):
        return _fast_path_attention(x, x, x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                                    mask_type)[0]

    def feed_forward(x):
        h = _dense(x, ffn_weight_1, ffn_bias_1)
        return _dense(jax.nn.gelu(h, approximate=False) if use_gelu else jax.nn.relu(h), ffn_weight_2, ffn_bias_2)

    def norm(x, weight, bias):
        return _layer_norm(x, (embed_dim,), weight, bias, eps)[0]

    x = src
    if norm_first:
        x = x + attention(norm(x, norm_weight_1, norm_bias_1))
        return x + feed_forward(norm(x, norm_weight_2, norm_bias_2))
    x = norm(x + attention(x), norm_weight_1, norm_bias_1)
    return norm(x + feed_forward(x), norm_weight_2, norm_bias_2)


class NestedTensorRequested(OpError):
    """A nested tensor was asked for; the jax device has none."""


@register(aten._nested_tensor_from_mask.default)
def _nested_tensor_from_mask(t, mask, mask_check=True):
    raise NestedTensorRequested(
        "torch2jax: _nested_tensor_from_mask: the jax device has no nested tensors (nn.TransformerEncoder's "
        "nested path is taken for it without them)"
    )


def _encoder_forward(forward):
    """nn.TransformerEncoder.forward taking its nested-tensor path on the jax device without
    nested tensors. In eval mode without grad, given a ``src_key_padding_mask``, torch packs
    the valid tokens of each sequence into a nested tensor, runs the layers on it and pads
    the result with zeros before the final norm. Here the layers run on the padded batch with
    the padding mask (the valid tokens' results are the same), the padded positions are
    zeroed where torch's mask check would have let it nest (a left-aligned mask), and then the
    norm is applied: the result is torch's, and no value decides the path (it traces)."""

    @functools.wraps(forward)
    def run(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        from ..tensor import Tensor

        if not (isinstance(src, Tensor) and getattr(self, "use_nested_tensor", False)):
            return forward(self, src, mask, src_key_padding_mask, is_causal)
        check, self.mask_check = self.mask_check, False
        try:
            return forward(self, src, mask, src_key_padding_mask, is_causal)
        except NestedTensorRequested:
            pass
        finally:
            self.mask_check = check
        norm, self.norm, self.use_nested_tensor = self.norm, None, False
        try:
            out = forward(self, src, mask, src_key_padding_mask, is_causal)
        finally:
            self.norm, self.use_nested_tensor = norm, True
        pad = src_key_padding_mask.bool()
        if not self.layers[0].self_attn.batch_first:
            pad = pad.t()
        zeroed = out.masked_fill(pad.unsqueeze(-1), 0.0)
        if check:
            padded = src_key_padding_mask.bool()
            left_aligned = (padded[:, 1:] >= padded[:, :-1]).all()
            zeroed = torch.where(left_aligned, zeroed, out)
        return zeroed if norm is None else norm(zeroed)

    return run


torch.nn.TransformerEncoder.forward = _encoder_forward(torch.nn.TransformerEncoder.forward)


def _detect_is_causal_mask(detect):
    """torch.nn.modules.transformer's check whether an attention mask is causal (``bool((mask ==
    causal).all())``), which needs the mask's value: of a traced mask (an argument of a jitted step) it
    says no, so that the layers apply the mask as given, with the same results as the causal path, and
    the trace goes on."""

    @functools.wraps(detect)
    def run(mask, is_causal=None, size=None):
        if is_causal is None and is_traced(mask):
            return False
        return detect(mask, is_causal, size)

    return run


torch.nn.modules.transformer._detect_is_causal_mask = _detect_is_causal_mask(
    torch.nn.modules.transformer._detect_is_causal_mask)


# -- CTC loss -----------------------------------------------------------------------


def _lse(*terms):
    """log(sum(exp(terms))) as torch's CTC kernel forms it: around the largest term, taken
    as 0 when every term is -inf (so that the result is -inf, not nan). The logarithm
    of that empty sum is taken at 1 and replaced, so its derivative is 0, not 0 * inf."""
    top = functools.reduce(jnp.maximum, terms)
    top = jnp.where(top == -jnp.inf, 0, top)
    total = sum(jnp.exp(t - top) for t in terms)
    empty = total == 0
    return jnp.where(empty, -jnp.inf, jnp.log(jnp.where(empty, 1, total)) + top)


_CTC_CHECK = " (while checking arguments for ctc_loss_allocate_outputs)"


def _check_ctc(log_probs, targets, input_lengths, target_lengths, blank):
    """torch's checks of ctc_loss's arguments, in its order and with its messages: XLA would
    read a target past its row (or past the concatenated targets) as padding, an input step
    past the end as the last one. The lengths' values are checked in eager mode, and when a traced
    program runs under ``check_indices="always"``."""
    if log_probs.ndim != 3:
        raise TorchRuntimeError(f"Expected 3-dimensional tensor, but got {log_probs.ndim}-dimensional tensor for "
                                f"argument #1 'log_probs'{_CTC_CHECK}")
    if not 1 <= targets.ndim <= 2:
        raise TorchRuntimeError(f"Expected 1 to 2 dimensions, but got {targets.ndim}-dimensional tensor for "
                                f"argument #2 'targets'{_CTC_CHECK}")
    steps, batch, labels = log_probs.shape
    if not 0 <= blank < labels:
        raise TorchRuntimeError("blank must be in label range")
    for name, lengths in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if np.size(lengths) != batch:
            raise TorchRuntimeError(f"{name} must be of size batch_size")
    # the lengths' values: read once and checked now, or checked when a traced program runs (`check_values`)
    tg_len, in_len = (v.reshape(-1) if isinstance(v, jax.core.Tracer) else np.asarray(v).reshape(-1)
                      for v in (target_lengths, input_lengths))
    check_values(tg_len, lambda v: v < 0, lambda v: TorchRuntimeError(
        f"Expected target_lengths to have value at least 0, but got value {v}{_CTC_CHECK}"))
    if targets.ndim == 1:
        check_values(tg_len.sum()[None], lambda n: n != targets.shape[0], lambda n: TorchRuntimeError(
            f"Expected tensor to have size {n} at dimension 0, but got size {targets.shape[0]} for argument #2 "
            f"'targets'{_CTC_CHECK}"))
    elif targets.shape[0] != batch:
        raise TorchRuntimeError(f"Expected tensor to have size {batch} at dimension 0, but got size "
                                f"{targets.shape[0]} for argument #2 'targets'{_CTC_CHECK}")
    elif batch:
        check_values(tg_len.max()[None], lambda n: n > targets.shape[1], lambda n: TorchRuntimeError(
            f"Expected tensor to have size at least {n} at dimension 1, but got size {targets.shape[1]} for "
            f"argument #2 'targets'{_CTC_CHECK}"))
    check_values(in_len, lambda v: (v < 0) | (v > steps), lambda v: TorchRuntimeError(
        f"Expected input_lengths to have value at {'least 0' if v < 0 else f'most {steps}'}, but got value "
        f"{v}{_CTC_CHECK}"))


@register(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    _check_ctc(log_probs, targets, input_lengths, target_lengths, blank)
    nll, log_alpha = _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank)
    steps, batch = log_probs.shape[:2]
    inside = jnp.arange(steps)[:, None] < jnp.asarray(input_lengths, np.int64).reshape(batch)[None, :]
    return _with_ctc_kernel_slope(nll, log_probs, inside), log_alpha


@jax.custom_jvp
def _with_ctc_kernel_slope(nll, log_probs, inside):
    """``nll``, whose JAX derivative with respect to ``log_probs`` is torch's (`_ctc_loss_backward`): the true
    one plus ``exp(log_probs)`` at each step ``inside`` the input's length."""
    return nll


@_with_ctc_kernel_slope.defjvp
def _with_ctc_kernel_slope_jvp(primals, tangents):
    nll, log_probs, inside = primals
    extra = jnp.sum(jnp.where(inside[..., None], jnp.exp(log_probs) * tangents[1], 0), axis=(0, 2))
    return nll, tangents[0] + extra.astype(nll.dtype)


def _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank):
    """(neg_log_likelihood [B], log_alpha [B, T, 2 S + 1]) by the forward (alpha) recursion.

    S is the longest target as torch sizes it when the lengths are known; under a trace
    (lengths traced) it is the padded target width, an upper bound: the extra columns of
    log_alpha are -inf, like every entry torch's kernel leaves unwritten.
    """
    lp = log_probs.astype(_opmath_of(log_probs.dtype))
    steps, batch = lp.shape[:2]
    in_len = jnp.asarray(input_lengths, np.int64).reshape(batch)
    tg_len = jnp.asarray(target_lengths, np.int64).reshape(batch)
    known = not isinstance(tg_len, jax.core.Tracer)
    if targets.ndim == 1:  # concatenated targets
        width = int(np.max(np.asarray(tg_len), initial=0)) if known else targets.shape[0]
        start = jnp.cumsum(tg_len) - tg_len
        pos = start[:, None] + jnp.arange(width)[None, :]
        if targets.size:
            tg = jnp.take(targets, jnp.clip(pos, 0, targets.shape[0] - 1), axis=0)
        else:
            tg = jnp.zeros((batch, width), targets.dtype)
    else:
        width = int(np.max(np.asarray(tg_len), initial=0)) if known else targets.shape[1]
        tg = targets[:, :width]
    states = 2 * width + 1
    s = jnp.arange(states)
    # the extended label sequence: blank, l1, blank, l2, ..., blank
    if width:
        picked = tg.astype(np.int64)[:, np.clip((np.arange(states) - 1) // 2, 0, width - 1)]
    else:
        picked = jnp.full((batch, states), blank, np.int64)
    label = jnp.where(s % 2 == 0, blank, picked)
    live = s[None, :] < 2 * tg_len[:, None] + 1
    skip = (s[None, :] % 2 == 1) & (s[None, :] >= 2) & (label != jnp.roll(label, 2, axis=1))
    emit = jnp.take_along_axis(lp, jnp.broadcast_to(label[None], (steps, batch, states)), axis=2)  # [T, B, S']
    neg = jnp.asarray(-jnp.inf, lp.dtype)
    first = jnp.where((s[None, :] == 0) | ((s[None, :] == 1) & (tg_len[:, None] > 0)), emit[0], neg)
    first = jnp.where(live, first, neg)

    def step(alpha, inputs):
        t, e = inputs
        prev1 = jnp.pad(alpha, ((0, 0), (1, 0)), constant_values=-jnp.inf)[:, :-1]
        prev2 = jnp.where(skip, jnp.pad(alpha, ((0, 0), (2, 0)), constant_values=-jnp.inf)[:, :-2], neg)
        new = jnp.where(live, _lse(alpha, prev1, prev2) + e, neg)
        active = (t < in_len)[:, None]
        return jnp.where(active, new, alpha), jnp.where(active, new, neg)

    last, rest = lax.scan(step, first, (jnp.arange(1, steps), emit[1:]))
    log_alpha = jnp.concatenate([first[None], rest], axis=0) if steps else jnp.zeros((0, batch, states), lp.dtype)
    end = 2 * tg_len
    l1 = jnp.take_along_axis(last, end[:, None], axis=1)[:, 0]
    l2 = jnp.where(tg_len > 0, jnp.take_along_axis(last, jnp.maximum(end - 1, 0)[:, None], axis=1)[:, 0], neg)
    nll = -_lse(l1, l2)
    return nll.astype(log_probs.dtype), jnp.moveaxis(log_alpha, 0, 1).astype(log_probs.dtype)


@register(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def _ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                       blank, zero_infinity=False):
    """The gradient torch's CTC kernels return: not d nll / d log_probs alone but that plus
    ``exp(log_probs) * grad`` at every step inside the input length, so that it is the
    gradient with respect to the logits once it passes back through a log_softmax (whose
    backward takes away ``exp(log_probs) * sum(grad)`` again). Steps past an input's length
    get 0; a sample whose loss is infinite gets nan there, or 0 with ``zero_infinity``."""
    steps, batch = log_probs.shape[:2]

    def nll(lp):
        return _ctc_forward(lp, targets, input_lengths, target_lengths, blank)[0]

    g = grad.astype(log_probs.dtype).reshape(batch)
    (true_grad,) = _vjp(nll, (log_probs,), g)
    out = true_grad + jnp.exp(log_probs) * g[None, :, None]
    in_len = jnp.asarray(input_lengths, np.int64).reshape(batch)
    keep = jnp.arange(steps)[:, None] < in_len[None, :]
    infinite = jnp.isinf(neg_log_likelihood)[None, :]
    if zero_infinity:
        keep = keep & ~infinite
    else:  # torch's exp(log_alpha + log_beta + nll - log_probs) is exp(-inf + inf) there
        out = jnp.where(infinite[..., None], jnp.nan, out)
    return jnp.where(keep[..., None], out, 0).astype(log_probs.dtype)


def ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False):
    """The AutogradPrivateUse1 kernel of aten::ctc_loss.Tensor. CTC code keeps the lengths on
    the CPU, as CUDA's kernels read them there; torch's composite divides the loss by
    ``target_lengths`` as given when an argument is a tensor subclass, which would mix
    devices. The lengths move to the device first, then torch's composite runs (autograd
    included)."""
    device = log_probs.device
    return aten.ctc_loss.Tensor.decompose(
        log_probs, targets, input_lengths.to(device), target_lengths.to(device), blank, reduction, zero_infinity
    )


_library.impl("ctc_loss.Tensor", ctc_loss_tensor, "AutogradPrivateUse1")


def _opmath_of(dtype):
    return _F32 if dtype in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)) else dtype
