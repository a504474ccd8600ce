"""Lowerings: convolution, pooling, upsampling and padding.

Pooling windows are gathered explicitly (`_windows`): each output position gets
the input positions of its window plus a validity mask, which gives max pooling
its torch-style indices (flat positions in the input plane) and average pooling
its exact divisors. Backward ops of linear forwards are their `jax.vjp`.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes as _dt
from ..dispatch import HostFallback, TorchRuntimeError
from .indexing import raise_as_torch
from .creation import linspace
from .nn import _vjp, upcast
from .registry import (argmax_index, canonical_dim, op_by_op, refused_dtypes, register, scalar_type_name,
                       true_divide)

aten = torch.ops.aten
prims = torch.ops.prims


def _tuple(v, n):
    """torch's int-or-list pooling / conv argument as an n-tuple."""
    if isinstance(v, int):
        return (v,) * n
    v = tuple(v)
    return v * n if len(v) == 1 else v


def _linear_backward(forward, shape, dtype, grad):
    """The transpose of the linear map ``forward`` (input of ``shape``) applied to ``grad``."""
    return _vjp(forward, (jnp.zeros(shape, dtype),), grad)[0]


# -- convolution -------------------------------------------------------------------


def _conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    n = x.ndim - 2
    stride, padding, dilation = _tuple(stride, n), _tuple(padding, n), _tuple(dilation, n)
    spatial = "DHW"[-n:] if n <= 3 else None
    dims = jax.lax.conv_dimension_numbers(x.shape, weight.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    half = x.dtype in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
    pref = np.float32 if half else None
    if transposed:
        output_padding = _tuple(output_padding, n)
        k = weight.shape[2:]
        cin, cout_g = weight.shape[0], weight.shape[1]
        w = weight.reshape((groups, cin // groups, cout_g) + k)
        w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + k)
        w = jnp.flip(w, axis=tuple(range(2, 2 + n)))
        pads = [
            (d * (kk - 1) - p, d * (kk - 1) - p + op)
            for kk, p, d, op in zip(k, padding, dilation, output_padding)
        ]
        out = jax.lax.conv_general_dilated(
            x, w, (1,) * n, pads, lhs_dilation=stride, rhs_dilation=dilation,
            dimension_numbers=dims, feature_group_count=groups, preferred_element_type=pref,
        )
    else:
        out = jax.lax.conv_general_dilated(
            x, weight, stride, [(p, p) for p in padding], rhs_dilation=dilation,
            dimension_numbers=dims, feature_group_count=groups, preferred_element_type=pref,
        )
    if bias is not None:
        out = out + upcast(bias).reshape((1, -1) + (1,) * n)
    return out.astype(x.dtype)


@functools.cache
def _onednn_bfloat16() -> bool:
    """Whether torch CPU runs bfloat16 convolutions through oneDNN on this machine (a CPU
    with AVX-512 or native bfloat16), which sums in float32 and rounds once."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _rounds_per_tap(dtype) -> bool:
    """Whether torch CPU's transposed convolution in ``dtype`` is its slow kernel, which
    rounds after each kernel tap (`_conv_transpose_half`): float16 always, bfloat16 where
    oneDNN does not take it."""
    return dtype == np.dtype(jnp.float16) or (dtype == np.dtype(jnp.bfloat16) and not _onednn_bfloat16())


def _conv_transpose_half(x, weight, bias, stride, padding, dilation, output_padding, groups):
    """A float16 / bfloat16 transposed convolution rounded where torch CPU's kernel rounds.

    torch CPU (slow_conv_transpose) multiplies input by weight into half-precision
    columns (one rounding per kernel tap, the sum over input channels in float32),
    scatters those columns into the output one tap after another, rounding after
    each addition, and adds the bias last. Computing it in float32 and rounding once
    differs from torch by several half-precision ulps, so the taps are accumulated in
    the same order here.
    """
    n = x.ndim - 2
    stride, padding, dilation = _tuple(stride, n), _tuple(padding, n), _tuple(dilation, n)
    output_padding = _tuple(output_padding, n)
    batch, cin = x.shape[:2]
    ins, k = x.shape[2:], weight.shape[2:]
    cout_g = weight.shape[1]
    outs = [(i - 1) * s - 2 * p + d * (kk - 1) + op + 1
            for i, s, p, d, kk, op in zip(ins, stride, padding, dilation, k, output_padding)]
    taps = int(np.prod(k))
    xs = x.reshape((batch, groups, cin // groups, -1))
    ws = weight.reshape((groups, cin // groups, cout_g, taps))
    cols = jnp.einsum("ngci,gcdt->tngdi", xs, ws, preferred_element_type=np.float32).astype(x.dtype)
    cols = cols.reshape((taps, batch, groups * cout_g) + tuple(ins))
    out = jnp.zeros((batch, groups * cout_g) + tuple(outs), x.dtype)
    zero = jnp.zeros((), x.dtype)
    for t, tap in enumerate(np.ndindex(*k)):
        config = [(0, 0, 0), (0, 0, 0)]
        for i, s, p, d, kk, o in zip(ins, stride, padding, dilation, tap, outs):
            lo = kk * d - p
            config.append((lo, o - lo - (i - 1) * s - 1, s - 1))
        out = out + jax.lax.pad(cols[t], zero, config)
    if bias is not None:
        out = out + bias.astype(x.dtype).reshape((1, -1) + (1,) * n)
    return out


# -- argument checks --------------------------------------------------------------------
#
# XLA pads, crops or returns an empty result where torch rejects the arguments (a kernel
# larger than the padded input, an output padding as large as the stride), or fails with
# a message of its own; these are torch's checks (aten::_convolution's, then its slow
# transposed kernels'), in its order and with its messages. They read only shapes and
# static arguments, so they run when the compiled lowering is traced, not on every call.


def _conv_param(name, v, n):
    """A conv argument as an n-tuple: one value stands for every spatial dimension."""
    v = (v,) if isinstance(v, int) else tuple(v)
    if len(v) == 1:
        return v * n
    if len(v) != n:
        raise TorchRuntimeError(f"expected {name} to be a single integer value or a list of {n} values to match the "
                                f"convolution dimensions, but got {name}={list(v)}")
    return v


def _sizes(values):
    return " x ".join(map(str, values))


def _check_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if weight.ndim < 3:
        raise TorchRuntimeError("weight should have at least three dimensions")
    if groups <= 0:
        raise TorchRuntimeError("non-positive groups is not supported")
    n = weight.ndim - 2
    stride, padding, dilation, output_padding = (
        _conv_param(name, v, n)
        for name, v in (("stride", stride), ("padding", padding), ("dilation", dilation),
                        ("output_padding", output_padding))
    )
    if min(padding) < 0:
        raise TorchRuntimeError("negative padding is not supported")
    if min(output_padding) < 0:
        raise TorchRuntimeError("negative output_padding is not supported")
    if min(stride) <= 0:
        raise TorchRuntimeError("non-positive stride is not supported")
    if min(dilation) <= 0:
        raise TorchRuntimeError("dilation should be greater than zero")
    w = list(weight.shape)
    if x.ndim != weight.ndim:
        raise TorchRuntimeError(f"Expected {weight.ndim}-dimensional input for {weight.ndim}-dimensional weight {w}, "
                                f"but got {x.ndim}-dimensional input of size {list(x.shape)} instead")
    if w[0] < groups:
        raise TorchRuntimeError(f"Given groups={groups}, expected weight to be at least {groups} at dimension 0, but "
                                f"got weight of size {w} instead")
    if w[0] % groups:
        raise TorchRuntimeError(f"Given groups={groups}, expected weight to be divisible by {groups} at dimension 0, "
                                f"but got weight of size [{w}] instead")  # sic: torch prints the brackets twice
    if transposed:
        _check_conv_transpose(x, w, bias, stride, padding, dilation, output_padding, groups)
    else:
        _check_conv_forward(x, w, bias, padding, dilation, groups)


def _check_conv_forward(x, w, bias, padding, dilation, groups):
    if x.shape[1] != w[1] * groups:
        raise TorchRuntimeError(f"Given groups={groups}, weight of size {w}, expected input{list(x.shape)} to have "
                                f"{w[1] * groups} channels, but got {x.shape[1]} channels instead")
    if bias is not None and bias.shape != (w[0],):
        raise TorchRuntimeError(f"Given weight of size {w}, expected bias to be 1-dimensional with {w[0]} elements, "
                                f"but got bias of size {list(bias.shape)} instead")
    padded = [i + 2 * p for i, p in zip(x.shape[2:], padding)]
    kernel = [d * (k - 1) + 1 for k, d in zip(w[2:], dilation)]
    if any(i < k for i, k in zip(padded, kernel)):
        raise TorchRuntimeError(f"Calculated padded input size per channel: ({_sizes(padded)}). Kernel size: "
                                f"({_sizes(kernel)}). Kernel size can't be greater than actual input size")


def _check_conv_transpose(x, w, bias, stride, padding, dilation, output_padding, groups):
    if x.shape[1] != w[0]:
        raise TorchRuntimeError(f"Given transposed=1, weight of size {w}, expected input{list(x.shape)} to have "
                                f"{w[0]} channels, but got {x.shape[1]} channels instead")
    if bias is not None and bias.shape != (w[1] * groups,):
        raise TorchRuntimeError(f"Given transposed=1, weight of size {w}, expected bias to be 1-dimensional with "
                                f"{w[1] * groups} elements, but got bias of size {list(bias.shape)} instead")
    # torch's CPU kernels run a 1-d transposed convolution as a 2-d one of height 1 and say so
    ins, k = tuple(x.shape[2:]), tuple(w[2:])
    if len(ins) == 1:
        ins, k, stride, padding, dilation, output_padding = (
            (one,) + v for one, v in zip((1, 1, 1, 0, 1, 0), (ins, k, stride, padding, dilation, output_padding))
        )
    if any(op >= s and op >= d for op, s, d in zip(output_padding, stride, dilation)):
        axes = ("depth", "height", "width")[-len(ins):]
        got = " ".join(f"{name}_{axis}: {v}" for name, values in
                       (("output_padding", output_padding), ("stride", stride), ("dilation", dilation))
                       for axis, v in zip(axes, values))
        raise TorchRuntimeError(f"output padding must be smaller than either stride or dilation, but got {got}")
    outs = [(i - 1) * s - 2 * p + d * (kk - 1) + 1 + op
            for i, s, p, d, kk, op in zip(ins, stride, padding, dilation, k, output_padding)]
    if min(outs) < 1:
        raise TorchRuntimeError(f"Given input size per channel: ({_sizes(ins)}). Calculated output size per channel: "
                                f"({_sizes(outs)}). Output size is too small")


def _check_conv_dtypes(x, weight, bias, transposed):
    """torch's error for operands of different dtypes ("expected scalar type Float but found
    Double", "Input type (float) and bias type (double) ..."), from its kernel run on
    one-element stand-ins."""
    if weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        return
    n = x.ndim - 2
    ones = (1, 1) + (1,) * n

    def one(a, shape):
        return None if a is None else torch.ones(shape, dtype=_dt.to_torch(a.dtype))

    raise_as_torch(aten.convolution, one(x, ones), one(weight, ones), one(bias, (1,)), [1] * n, [0] * n, [1] * n,
                   transposed, [0] * n, 1)


# torch's CPU convolutions compute no bools, its transposed ones no integers narrower than int64
refused_dtypes(aten.convolution, kinds="b", dtypes=(torch.uint8, torch.int8, torch.int16, torch.int32))


@register(aten.convolution.default)
def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    _check_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    _check_conv_dtypes(x, weight, bias, transposed)
    if transposed and _rounds_per_tap(x.dtype) and 0 not in x.shape:
        return _conv_transpose_half(x, weight, bias, stride, padding, dilation, output_padding, groups)
    return _conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@register(aten.convolution_backward.default)
def convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                         output_mask):
    def forward(a, w):
        return _conv(a, w, None, stride, padding, dilation, transposed, output_padding, groups)

    gx, gw = _vjp(forward, (x, weight), grad)
    gb = jnp.sum(upcast(grad), axis=(0,) + tuple(range(2, grad.ndim))).astype(grad.dtype) if output_mask[2] else None
    return gx if output_mask[0] else None, gw if output_mask[1] else None, gb


# -- pooling windows ------------------------------------------------------------------


def _pool_out(size, k, s, p, d, ceil_mode):
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return max(out, 0)


def _sliding(size, k, s, p, d, ceil_mode):
    """(positions [out, k], valid [out, k]) of a sliding window along one dim."""
    out = _pool_out(size, k, s, p, d, ceil_mode)
    pos = np.arange(out)[:, None] * s - p + np.arange(k)[None, :] * d
    return pos, (pos >= 0) & (pos < size)


def _adaptive(size, out):
    """(positions, valid) of adaptive pooling windows along one dim."""
    start = (np.arange(out) * size) // out
    end = -((-(np.arange(out) + 1) * size) // out)
    k = int((end - start).max()) if out else 0
    pos = start[:, None] + np.arange(k)[None, :]
    return pos, pos < end[:, None]


def _windows(x, geometry):
    """Gather pooling windows over the trailing ``len(geometry)`` dims of ``x``.

    Returns (patches [..., *out, K], valid [*out, K], flat input index [*out, K]),
    K being the product of the window sizes.
    """
    n = len(geometry)
    lead = x.ndim - n
    sizes = x.shape[lead:]
    patches = x
    for i, (pos, _) in enumerate(geometry):
        ax = lead + 2 * i
        taken = jnp.take(patches, np.clip(pos, 0, sizes[i] - 1).reshape(-1), axis=ax)
        patches = taken.reshape(taken.shape[:ax] + pos.shape + taken.shape[ax + 1:])
    order = [lead + 2 * i for i in range(n)] + [lead + 2 * i + 1 for i in range(n)]
    patches = jnp.transpose(patches, tuple(range(lead)) + tuple(order))
    outs = tuple(pos.shape[0] for pos, _ in geometry)
    window = math.prod(pos.shape[1] for pos, _ in geometry)
    patches = patches.reshape(patches.shape[:lead] + outs + (window,))
    valid = np.ones((), bool)
    flat = np.zeros((), np.int64)
    for i, (pos, ok) in enumerate(geometry):
        shape = [1] * (2 * n)
        shape[i], shape[n + i] = pos.shape
        valid = valid & ok.reshape(shape)
        flat = flat * sizes[i] + pos.reshape(shape)
    return patches, valid.reshape(outs + (-1,)), flat.reshape(outs + (-1,))


def _lowest(dtype):
    return -np.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _window_max(vals, flat):
    """(max, its flat input index) over the last axis of the windows ``vals``."""
    arg = argmax_index(vals, axis=-1)[..., None]
    out = jnp.take_along_axis(vals, arg, axis=-1)[..., 0]
    return out, jnp.take_along_axis(jnp.broadcast_to(flat, vals.shape), arg, axis=-1)[..., 0]


def _max_windows(x, geometry):
    patches, valid, flat = _windows(x, geometry)
    return _window_max(jnp.where(valid, patches, jnp.asarray(_lowest(x.dtype), x.dtype)), flat)


def _check_pool(x, n, k, s, p, d, name):
    """torch's checks of a pooling's arguments and input, in its order and words (its shape
    checks name the kernel ``name`` in 3-d)."""
    batched = n + 2
    if x.ndim not in (n + 1, batched):
        raise TorchRuntimeError(f"non-empty {n + 1}D or {batched}D (batch mode) tensor expected for input")
    for ki, si, pi, di in zip(k, s, p, d):  # pooling_output_shape, per dim
        if si == 0:
            raise TorchRuntimeError("stride should not be zero")
        if pi < 0:
            raise TorchRuntimeError(f"pad must be non-negative, but got pad: {pi}")
        if pi > ((ki - 1) * di + 1) // 2:
            raise TorchRuntimeError(f"pad should be at most half of effective kernel size, but got pad={pi}, "
                                    f"kernel_size={ki} and dilation={di}")
    axes = "THW"[3 - n:]
    if min(d) <= 0:
        got = " ".join(f"dilation{a}: {v}" for a, v in zip(axes, d))
        raise TorchRuntimeError(f"dilation should be greater than zero, but got {got}")
    empty = [i for i in range(x.ndim == batched, x.ndim) if x.shape[i] == 0]  # the batch may be empty
    if empty and n == 2:
        raise TorchRuntimeError("Expected 3D or 4D (batch mode) tensor with optional 0 dim batch size for input, "
                                f"but got:{list(x.shape)}")
    if empty:
        raise TorchRuntimeError(f"{name}: Expected input's non-batch dimensions to have positive length, but input "
                                f"has a shape of {list(x.shape)} and non-batch dimension {empty[0]} has length zero!")
    if any(pi > ki // 2 for ki, pi in zip(k, p)):
        if n == 2:
            got = f"padW = {p[1]}, padH = {p[0]}, kW = {k[1]}, kH = {k[0]}"
        else:
            got = f"kT: {k[0]} kW: {k[2]} kH: {k[1]} padT: {p[0]} padW: {p[2]} padH: {p[1]}"
        raise TorchRuntimeError(f"pad should be smaller than or equal to half of kernel size, but got {got}")


def _max_pool(x, n, kernel_size, stride, padding, dilation, ceil_mode):
    k = _tuple(kernel_size, n)
    s = _tuple(stride, n) if stride else k
    p, d = _tuple(padding, n), _tuple(dilation, n)
    _check_pool(x, n, k, s, p, d, "max_pool3d_with_indices_out_cpu_template()")
    geometry = [_sliding(x.shape[x.ndim - n + i], k[i], s[i], p[i], d[i], ceil_mode) for i in range(n)]
    return _max_windows(x, geometry)


# torch's CPU max pools compare real numbers, not bools; their backward kernels (int64 indices) are floating only
refused_dtypes(aten.max_pool2d_with_indices, aten.max_pool3d_with_indices, kinds="bc")
refused_dtypes(aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward, kinds="bic", operands=2)


@register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, 2, kernel_size, stride, padding, dilation, ceil_mode)


@register(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, 3, kernel_size, stride, padding, dilation, ceil_mode)


def _scatter_indices(grad, x, indices, n):
    """Add each ``grad`` element at its flat position ``indices`` of ``x``'s trailing n-d plane."""
    lead = x.shape[: x.ndim - n]
    b = math.prod(lead)
    plane = math.prod(x.shape[x.ndim - n:])
    g = upcast(grad).reshape(b, math.prod(grad.shape[len(lead):]))  # no -1: the batch may be empty
    idx = indices.reshape(g.shape)
    out = jnp.zeros((b, plane), g.dtype).at[jnp.arange(b)[:, None], idx].add(g)
    return out.reshape(x.shape).astype(x.dtype)


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_indices(grad, x, indices, 2)


@register(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_indices(grad, x, indices, 3)


def _fractional_starts(sample, size, out, pool):
    """Each plane's window starts along one dim from its random sample in [0, 1), as torch's
    generate_intervals computes them (in the sample's dtype, truncated); the last window
    ends at the input's end."""
    if out == 0:
        return jnp.zeros(sample.shape + (0,), np.int64)
    alpha = jnp.asarray((size - pool) / (out - 1) if out > 1 else 0, sample.dtype)
    i = jnp.arange(out, dtype=sample.dtype)
    starts = (jnp.trunc((i + sample[..., None]) * alpha) - jnp.trunc(sample * alpha)[..., None]).astype(np.int64)
    return starts.at[..., -1].set(size - pool)


def _fractional_max_pool(x, kernel_size, output_size, samples, sample_of_dim):
    """(values, flat indices) of max pooling over windows at pseudo-random fractional
    strides: ``samples[..., sample_of_dim[i]]`` places the windows of spatial dim i."""
    n = len(sample_of_dim)
    name = f"fractional_max_pool{n}d()"
    k, outs = _tuple(kernel_size, n), _tuple(output_size, n)
    if x.ndim not in (n + 1, n + 2):
        raise RuntimeError(f"{name}: Expected {n + 1}D or {n + 2}D tensor, but got: {list(x.shape)}")
    if 0 in x.shape[x.ndim - n - 1:]:
        raise RuntimeError(f"{name}: Expected input to have non-zero size for non-batch dimensions, but got "
                           f"{list(x.shape)}")
    sizes = x.shape[x.ndim - n:]
    for name_of_dim, size, pool, out in zip(("time", "height", "width")[3 - n:], sizes, k, outs):
        if out + pool - 1 > size:
            raise RuntimeError(f"{name}: pool {name_of_dim} {pool} too large relative to input {name_of_dim} {size}")
    batched = x if x.ndim == n + 2 else x[None]
    if samples.ndim != 3 or samples.shape[0] < batched.shape[0]:
        raise RuntimeError("Expect _random_samples.size(0) no less then input batch size.")
    if samples.shape[1] != batched.shape[1]:
        raise RuntimeError("Expect _random_samples.size(1) equals to input channel size.")
    if samples.shape[2] != n:
        raise RuntimeError(f"Expect _random_samples.size(2) equals to {n}; got {samples.shape[2]}.")
    # torch's kernel reads the samples as a flat N x C x n block from their start (an
    # unbatched input given a batch of samples uses the first one's)
    count = math.prod(batched.shape[:2]) * n
    samples = samples.reshape(-1)[:count].reshape(batched.shape[:2] + (n,))
    samples = samples.astype(x.dtype if x.dtype != jnp.float16 else np.float32)
    flat = jnp.zeros((), np.int64)
    for i in range(n):
        starts = _fractional_starts(samples[..., sample_of_dim[i]], sizes[i], outs[i], k[i])
        pos = starts[..., :, None] + np.arange(k[i])  # (N, C, out_i, k_i)
        shape = list(pos.shape[:2]) + [1] * (2 * n)
        shape[2 + i], shape[2 + n + i] = pos.shape[2:]
        flat = flat * sizes[i] + pos.reshape(shape)
    flat = flat.reshape(flat.shape[:2 + n] + (math.prod(k),))  # explicit sizes: a batch may be empty
    plane = batched.reshape(batched.shape[:2] + (math.prod(sizes),))
    picks = flat.reshape(flat.shape[:2] + (math.prod(flat.shape[2:]),))
    out, idx = _window_max(jnp.take_along_axis(plane, picks, axis=2).reshape(flat.shape), flat)
    if x.ndim == n + 1:
        out, idx = out[0], idx[0]
    return out, idx


refused_dtypes(aten.fractional_max_pool2d, aten.fractional_max_pool3d, kinds="bic", operands=1)  # (floating only)


@register(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(x, kernel_size, output_size, random_samples, (1, 0))


@register(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(x, kernel_size, output_size, random_samples, (0, 1, 2))


@register(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad, x, kernel_size, output_size, indices):
    return _scatter_indices(grad, x, indices, 2)


@register(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad, x, kernel_size, output_size, indices):
    return _scatter_indices(grad, x, indices, 3)


def _adaptive_geometry(x, output_size, n):
    return [_adaptive(x.shape[x.ndim - n + i], o) for i, o in enumerate(_tuple(output_size, n))]


def _check_adaptive_max(x, output_size, n):
    name = f"adaptive_max_pool{n}d()"
    if x.ndim not in (n + 1, n + 2):
        raise TorchRuntimeError(f"{name}: Expected {n + 1}D or {n + 2}D tensor, but got: {list(x.shape)}")
    for i in range(1, x.ndim):
        if x.shape[i] == 0:
            raise TorchRuntimeError(f"{name}: Expected input to have non-zero size for non-batch dimensions, but "
                                    f"input has sizes {list(x.shape)} with dimension {i} being empty")
    if len(output_size) != n:
        raise TorchRuntimeError(f"{name}: internal error: output_size.size() must be {n}")


# torch's CPU adaptive and average pools are floating only (avg_pool2d takes int64; avg_pool3d's float16 / bfloat16,
# which CUDA's kernel computes, are computed)
refused_dtypes(aten.adaptive_max_pool2d, aten.adaptive_max_pool3d, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d,
               aten.avg_pool2d, aten.avg_pool3d, kinds="bic")


def _no_windows(x, output_size, n):
    """The (empty) result of an adaptive pool of ``x`` to an ``output_size`` with a zero in it, or None:
    torch gives one, while gathering zero windows of zero elements has no shape to reduce."""
    if 0 not in output_size:
        return None
    return jnp.zeros(x.shape[:x.ndim - n] + tuple(output_size), x.dtype)


def _check_adaptive_grad(name, grad):
    """torch's adaptive pooling backward refuses a gradient empty past its batch dim (a pool to a size with a
    zero, or of no channels)."""
    for i in range(1, grad.ndim):
        if grad.shape[i] == 0:
            raise TorchRuntimeError(f"{name}_backward(): Expected grad_output to have non-zero size for non-batch "
                                    f"dimensions, but grad_output has sizes {list(grad.shape)} with dimension {i} "
                                    "being empty")


def _adaptive_max(x, output_size, n):
    _check_adaptive_max(x, output_size, n)
    empty = _no_windows(x, output_size, n)
    if empty is not None:
        return empty, empty.astype(np.int64)
    return _max_windows(x, _adaptive_geometry(x, output_size, n))


@register(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(x, output_size):
    return _adaptive_max(x, output_size, 2)


@register(aten.adaptive_max_pool3d.default)
def adaptive_max_pool3d(x, output_size):
    return _adaptive_max(x, output_size, 3)


@register(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad, x, indices):
    _check_adaptive_grad("adaptive_max_pool2d", grad)
    return _scatter_indices(grad, x, indices, 2)


@register(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad, x, indices):
    _check_adaptive_grad("adaptive_max_pool3d", grad)
    return _scatter_indices(grad, x, indices, 3)


def _avg_pool(x, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    k = _tuple(kernel_size, n)
    s = _tuple(stride, n) if stride else k
    p = _tuple(padding, n)
    if divisor_override == 0:  # (None is no override)
        raise TorchRuntimeError("divisor must be not zero")
    if n == 2:  # torch reads the channels' size before it checks the rank
        canonical_dim(-3, x.ndim)
    _check_pool(x, n, k, s, p, (1,) * n, "avg_pool3d()")
    sizes = x.shape[x.ndim - n:]
    geometry = [_sliding(sizes[i], k[i], s[i], p[i], 1, ceil_mode) for i in range(n)]
    patches, valid, _ = _windows(upcast(x), geometry)
    total = jnp.sum(jnp.where(valid, patches, 0), axis=-1)
    if divisor_override:
        count = divisor_override
    elif count_include_pad:
        count = np.ones((), np.int64)
        for i, (pos, _) in enumerate(geometry):
            inside = ((pos >= -p[i]) & (pos < sizes[i] + p[i])).sum(axis=1)
            count = count[..., None] * inside if count.ndim else inside
        count = count.reshape(total.shape[x.ndim - n:])
    else:
        count = valid.sum(axis=-1)
    return (total / count).astype(x.dtype)


@register(aten.avg_pool2d.default)
def avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(x, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register(aten.avg_pool3d.default)
def avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(x, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad, x, *args):
    return _linear_backward(lambda a: _avg_pool(a, 2, *args), x.shape, x.dtype, grad)


@register(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad, x, *args):
    return _linear_backward(lambda a: _avg_pool(a, 3, *args), x.shape, x.dtype, grad)


def _check_adaptive_avg(x, output_size, n):
    """torch's checks of an adaptive average pool's input, in its words: the 2-d pool needs non-empty
    spatial dims, the 3-d one every dim but the first non-empty (an empty window would average to NaN)."""
    name = f"adaptive_avg_pool{n}d"
    if len(output_size) != n:
        raise TorchRuntimeError(f"{name}: output_size must be {n}")
    if x.ndim not in (n + 1, n + 2):
        raise TorchRuntimeError(f"{name}(): Expected {n + 1}D or {n + 2}D tensor, but got {list(x.shape)}")
    for i in range(x.ndim - 2, x.ndim) if n == 2 else range(1, x.ndim):
        if x.shape[i] == 0:
            raise TorchRuntimeError(f"{name}(): Expected input to have non-zero size for non-batch dimensions, "
                                    f"but input has sizes {list(x.shape)} with dimension {i} being empty")


def _adaptive_avg(x, output_size, n):
    empty = _no_windows(x, output_size, n)
    if empty is not None:
        return empty
    patches, valid, _ = _windows(upcast(x), _adaptive_geometry(x, output_size, n))
    return (jnp.sum(jnp.where(valid, patches, 0), axis=-1) / valid.sum(axis=-1)).astype(x.dtype)


@register(aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(x, output_size):
    _check_adaptive_avg(x, output_size, 2)
    return _adaptive_avg(x, output_size, 2)


def _adaptive_avg3d_half(x, output_size):
    """torch CPU's 3d kernel sums a window in the input dtype, element by element in
    (t, h, w) order, then divides by the window's depth, height and width in turn; a
    float16 / bfloat16 result depends on those roundings."""
    geometry = _adaptive_geometry(x, output_size, 3)
    patches, valid, _ = _windows(x, geometry)
    total = jnp.zeros(patches.shape[:-1], x.dtype)
    for j in range(patches.shape[-1]):
        total = jnp.where(valid[..., j], total + patches[..., j], total)
    for i, (_, ok) in enumerate(geometry):
        shape = [1, 1, 1]
        shape[i] = -1
        # in float32: XLA turns a half-precision division by a constant into a multiplication
        # by its reciprocal rounded to half precision
        total = (total.astype(np.float32) / ok.sum(axis=-1).reshape(shape).astype(np.float32)).astype(x.dtype)
    return total


@register(aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool3d(x, output_size):
    _check_adaptive_avg(x, output_size, 3)
    if x.dtype in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)) and x.size and 0 not in output_size:
        return _adaptive_avg3d_half(x, output_size)
    return _adaptive_avg(x, output_size, 3)


@register(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(grad, x):
    _check_adaptive_grad("adaptive_avg_pool2d", grad)
    size = grad.shape[-2:]
    return _linear_backward(lambda a: _adaptive_avg(a, size, 2), x.shape, x.dtype, grad)


@register(aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool3d_backward(grad, x):
    _check_adaptive_grad("adaptive_avg_pool3d", grad)
    size = grad.shape[-3:]
    return _linear_backward(lambda a: _adaptive_avg(a, size, 3), x.shape, x.dtype, grad)


# -- upsampling ---------------------------------------------------------------------


def _src_scale(in_size, out_size, scale, align_corners=False):
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else in_size / out_size


def _check_resize(x, output_size, n):
    """torch's checks of an ``n``-d resizing's input (upsample_{n}d_common_check, then its meta function's),
    in its words: ranks, sizes above zero, and no empty dim but the batch. The backward lowerings run the
    forward on the input's shape, so they check as torch's do too."""
    if len(output_size) != n:
        raise TorchRuntimeError(f"It is expected output_size equals to {n}, but got size {len(output_size)}")
    if x.ndim != n + 2:
        raise TorchRuntimeError(f"It is expected input_size equals to {n + 2}, but got size {x.ndim}")
    sizes = x.shape[2:]
    if min(sizes) <= 0 or min(output_size) <= 0:
        def shown(values):
            return ", ".join(f"{a}: {v}" for a, v in zip("DHW"[3 - n:], values))
        between = ") and output (" if n == 1 else ") output ("
        raise TorchRuntimeError(f"Input and output sizes should be greater than 0, but got input ({shown(sizes)}"
                                f"{between}{shown(output_size)})")
    if x.shape[1] == 0:
        raise TorchRuntimeError(f"Non-empty {n + 2}D data tensor expected but got a tensor with sizes {list(x.shape)}")


def _nearest(x, output_size, scales, exact):
    n = len(output_size)
    for i, (o, sc) in enumerate(zip(output_size, scales)):
        ax = x.ndim - n + i
        size = x.shape[ax]
        # float32 index arithmetic, as torch's kernels, so that boundaries round the same way
        r = np.float32(1.0 / sc) if sc is not None and sc > 0 else np.float32(size) / np.float32(o)
        src = np.floor((np.arange(o, dtype=np.float32) + np.float32(0.5 if exact else 0.0)) * r).astype(np.int64)
        x = jnp.take(x, np.minimum(src, size - 1), axis=ax)
    return x


def _register_nearest(op, exact, n):
    def lowering(x, output_size, *scales):
        _check_resize(x, output_size, n)
        return _nearest(x, output_size, (tuple(scales) + (None,) * n)[:n], exact)

    def backward(grad, output_size, input_size, *scales):
        fwd = lambda a: lowering(a, output_size, *scales)  # noqa: E731
        return _linear_backward(fwd, tuple(input_size), grad.dtype, grad)

    register(getattr(aten, op).default)(lowering)
    register(getattr(aten, op + "_backward").default)(backward)


# torch's CPU resizing kernels are floating only, but for uint8 images (linear / trilinear: floating only; the
# antialiased ones' float16 / bfloat16, which CUDA's kernels compute, are computed)
_SIGNED = (torch.int8, torch.int16, torch.int32, torch.int64)
refused_dtypes(*(getattr(aten, f"{name}{n}d") for name in ("upsample_nearest", "_upsample_nearest_exact")
                 for n in (1, 2, 3)), aten.upsample_bilinear2d, aten.upsample_bicubic2d, kinds="bc", dtypes=_SIGNED)
refused_dtypes(aten.upsample_linear1d, aten.upsample_trilinear3d, kinds="bic")
refused_dtypes(aten._upsample_bilinear2d_aa, aten._upsample_bicubic2d_aa, kinds="bc", dtypes=_SIGNED)

for _n in (1, 2, 3):
    _register_nearest(f"upsample_nearest{_n}d", False, _n)
    _register_nearest(f"_upsample_nearest_exact{_n}d", True, _n)


# torch's CPU kernels compute source indices and weights in the op-math type (float32,
# float64 for float64 inputs), store the weights in the input dtype (so float16 /
# bfloat16 weights are rounded) and interpolate in the op-math type, rounding once.


def _linear_src(size, out, scale, align_corners, cubic=False, ftype=np.float32):
    if align_corners:
        r = ftype(size - 1) / ftype(out - 1) if out > 1 else ftype(0)
    elif scale is not None and scale > 0:
        r = ftype(1.0 / scale)
    else:
        r = ftype(size) / ftype(out)
    dst = np.arange(out, dtype=ftype)
    if align_corners:
        return dst * r
    src = (dst + ftype(0.5)) * r - ftype(0.5)
    return src if cubic else np.maximum(src, ftype(0))


def _weights(w, dtype):
    """Weights as torch stores them: in the input dtype, then read back in op math."""
    return jnp.asarray(w).astype(dtype).astype(_opmath(dtype))


def _opmath(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def _interp_axis(x, ax, out, scale, align_corners, dtype):
    size = x.shape[ax]
    src = _linear_src(size, out, scale, align_corners, ftype=_opmath(dtype))
    i0 = np.minimum(np.floor(src).astype(np.int64), size - 1)
    i1 = np.minimum(i0 + 1, size - 1)
    lam1 = np.clip(src - i0, 0, 1)
    shape = [1] * x.ndim
    shape[ax] = out
    lam1 = _weights(lam1.reshape(shape), dtype)
    lam0 = (1 - lam1.astype(dtype)).astype(lam1.dtype)
    return jnp.take(x, i0, axis=ax) * lam0 + jnp.take(x, i1, axis=ax) * lam1


_HALF_MANTISSA = {np.dtype(jnp.float16): 10, np.dtype(jnp.bfloat16): 7}


def _mul(x, y):
    """``x * y``, rounded before a sum it feeds where it is a half-precision array, as torch's Half
    kernels round after every operation: XLA:CPU's LLVM contracts a multiply and an add into one
    fused multiply-add (one rounding), natively in float16 on CPUs with AVX512-FP16. A
    ``reduce_precision`` to the dtype's own precision is an identity XLA keeps between them."""
    p = x * y
    bits = _HALF_MANTISSA.get(np.dtype(p.dtype)) if hasattr(p, "dtype") else None
    if bits is None:  # (a wider dtype, or Python numbers: a kernel weight's)
        return p
    return jax.lax.reduce_precision(jnp.asarray(p, jnp.float32), exponent_bits=8, mantissa_bits=bits).astype(p.dtype)


def _cubic_near(d, a):
    """Keys' cubic convolution kernel for |d| < 1 (``a``: -0.75 as torch's bicubic, -0.5 antialiased)."""
    return _mul(_mul(_mul(a + 2, d) - (a + 3), d), d) + 1


def _cubic_far(d, a):
    """The kernel for 1 <= |d| < 2."""
    return _mul(_mul(_mul(a, d) - _mul(5, a), d) + _mul(8, a), d) - _mul(4, a)


def _cubic_weights(t, a=-0.75):
    return (_cubic_far(t + 1, a), _cubic_near(t, a), _cubic_near(1 - t, a), _cubic_far(2 - t, a))


def _cubic_axis(x, ax, out, scale, align_corners, dtype):
    size = x.shape[ax]
    src = _linear_src(size, out, scale, align_corners, cubic=True, ftype=_opmath(dtype))
    i0 = np.floor(src).astype(np.int64)
    t = (src - i0).astype(_opmath(dtype))
    shape = [1] * x.ndim
    shape[ax] = out
    total = 0
    for j, w in enumerate(_cubic_weights(t)):
        total = total + jnp.take(x, np.clip(i0 - 1 + j, 0, size - 1), axis=ax) * _weights(w.reshape(shape), dtype)
    return total


def _interpolate(axis_fn, x, output_size, align_corners, scales, rounds=True):
    _check_resize(x, output_size, len(output_size))
    if x.dtype == np.uint8:
        raise HostFallback  # torch CPU resizes uint8 images in fixed point (its antialias kernel's)
    n = len(output_size)
    scales = (tuple(scales) + (None,) * n)[:n]
    out = upcast(x)
    weight_dtype = x.dtype if rounds else out.dtype
    for i, (o, sc) in enumerate(zip(output_size, scales)):
        out = axis_fn(out, x.ndim - n + i, o, sc, align_corners, weight_dtype)
    return out.astype(x.dtype)


def _register_interp(op, axis_fn, rounds=True):
    """``rounds``: whether torch's kernel stores the weights in the input dtype."""

    def lowering(x, output_size, align_corners, *scales):
        return _interpolate(axis_fn, x, output_size, align_corners, scales, rounds)

    def backward(grad, output_size, input_size, align_corners, *scales):
        fwd = lambda a: _interpolate(axis_fn, a, output_size, align_corners, scales, rounds)  # noqa: E731
        return _linear_backward(fwd, tuple(input_size), grad.dtype, grad)

    register(getattr(aten, op).default)(lowering)
    register(getattr(aten, op + "_backward").default)(backward)


_register_interp("upsample_linear1d", _interp_axis)
# torch CPU's bilinear 2d kernel keeps its weights in float32
_register_interp("upsample_bilinear2d", _interp_axis, rounds=False)
_register_interp("upsample_trilinear3d", _interp_axis)
_register_interp("upsample_bicubic2d", _cubic_axis)


# Antialiased resizing (PIL's algorithm, as torch's CPU kernels run it): each output
# pixel averages the input pixels under a filter stretched by the downscaling factor,
# with weights normalized to sum to 1; separable, the width first.


def _triangle(t):
    t = np.abs(t)
    return np.where(t < 1, 1 - t, 0)


def _keys_cubic(t, a=-0.5):
    t = np.abs(t)
    return np.where(t < 1, _cubic_near(t, a), np.where(t < 2, _cubic_far(t, a), 0))


def _aa_taps(size, out, scale, align_corners, support_size, kernel, ftype):
    """(first input index, weights) of each output pixel, weights as (out, taps) in ``ftype``."""
    if align_corners:
        r = ftype(size - 1) / ftype(out - 1) if out > 1 else ftype(0)
    else:
        r = ftype(1.0 / scale) if scale is not None and scale > 0 else ftype(size) / ftype(out)
    support = ftype(support_size / 2) * r if r >= 1 else ftype(support_size / 2)
    invscale = ftype(1) / r if r >= 1 else ftype(1)
    taps = int(math.ceil(support)) * 2 + 1
    center = r * (np.arange(out, dtype=ftype) + ftype(0.5))
    first = np.maximum((center - support + ftype(0.5)).astype(np.int64), 0)
    count = np.clip(np.minimum((center + support + ftype(0.5)).astype(np.int64), size) - first, 0, taps)
    j = np.arange(taps)
    w = kernel((j[None, :] + first[:, None] - center[:, None] + ftype(0.5)) * invscale).astype(ftype)
    w = np.where(j[None, :] < count[:, None], w, ftype(0))
    total = w.sum(axis=1, keepdims=True, dtype=ftype)
    return first, np.where(total != 0, w / np.where(total != 0, total, 1), w).astype(ftype)


def _aa_resize(x, output_size, align_corners, scales, support_size, kernel):
    _check_resize(x, output_size, 2)
    if x.dtype not in (np.float32, np.float64):
        raise HostFallback  # torch computes uint8 in fixed point and refuses the other dtypes
    ftype = _opmath(x.dtype)
    for ax, o, sc in reversed(list(zip(range(x.ndim - 2, x.ndim), output_size, scales))):
        size = x.shape[ax]
        first, w = _aa_taps(size, o, sc, align_corners, support_size, kernel, ftype)
        shape = [1] * x.ndim
        shape[ax] = o
        out = 0
        for k in range(w.shape[1]):
            tap = jnp.take(x, np.minimum(first + k, size - 1), axis=ax)
            out = out + tap * jnp.asarray(w[:, k].reshape(shape))
        x = out.astype(x.dtype)
    return x


def _register_aa(op, support_size, kernel):
    def lowering(x, output_size, align_corners, scales_h=None, scales_w=None):
        return _aa_resize(x, output_size, align_corners, (scales_h, scales_w), support_size, kernel)

    def backward(grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
        return _linear_backward(lambda a: lowering(a, output_size, align_corners, scales_h, scales_w),
                                tuple(input_size), grad.dtype, grad)

    register(getattr(aten, op).default)(lowering)
    register(getattr(aten, op + "_backward").default)(backward)


_register_aa("_upsample_bilinear2d_aa", 2, _triangle)
_register_aa("_upsample_bicubic2d_aa", 4, _keys_cubic)


# -- grid sampling ------------------------------------------------------------------
# torch CPU's grid_sampler_2d has a vectorized kernel for float32 / float64 only;
# float16 / bfloat16 take its scalar fallback, which does every step of the
# arithmetic in the half dtype (c10::Half rounds after each operation). The steps
# below are done in the input's dtype in that same order, each product rounded
# before the sum it feeds (`_mul`), so both paths match.


def _affine_axis(n, dtype, align_corners):
    """torch's linspace_from_neg_one: linspace(-1, 1, n), times (n - 1) / n unless corners align."""
    if n <= 1:
        return jnp.zeros((1,), dtype)
    r = linspace(-1, 1, n, dtype=_dt.to_torch(dtype))
    return r if align_corners else true_divide(r * jnp.asarray(n - 1, dtype), jnp.asarray(n, dtype))


@register(aten.affine_grid_generator.default)
def affine_grid_generator(theta, size, align_corners):
    """torch's native kernel (its decomposition spaces the grid with another linspace, off by an
    ulp, which moves nearest-mode samples at half-pixel ties): base grid (x, y[, z], 1) in the
    spatial shape, times theta transposed."""
    if len(size) not in (4, 5):
        raise RuntimeError("AffineGridGenerator needs 4d (spatial) or 5d (volumetric) inputs.")
    n, spatial = size[0], tuple(size[2:])
    axes = [_affine_axis(k, theta.dtype, align_corners) for k in spatial]
    k = len(spatial)
    coords = [jnp.broadcast_to(axes[d].reshape((-1,) + (1,) * (k - 1 - d)), spatial)
              for d in reversed(range(k))]  # x along the last axis, then y (and z)
    base = jnp.stack(coords + [jnp.ones(spatial, theta.dtype)], -1).reshape(1, -1, k + 1)
    grid = jnp.matmul(jnp.broadcast_to(base, (n,) + base.shape[1:]), jnp.swapaxes(theta, 1, 2),
                      precision=jax.lax.Precision.HIGHEST)
    return grid.reshape((n,) + spatial + (k,))


def _grid_clip(c, size):
    # by comparisons, not min / max: a coordinate on the border gets no gradient (torch's
    # clip_coordinates_set_grad), where max's would be split between the two sides
    c = jnp.where(c <= 0, jnp.zeros((), c.dtype), c)
    return jnp.where(c >= size - 1, jnp.asarray(size - 1, c.dtype), c)


def _grid_reflect(c, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(c)
    lo = jnp.asarray(twice_low, c.dtype) / 2
    span = jnp.asarray(twice_high - twice_low, c.dtype) / 2
    c = c - lo
    c = jnp.where(c < 0, -c, c)  # abs with torch's gradient of 1 at 0
    extra = jnp.fmod(c, span)
    flips = jnp.floor(true_divide(c, span))
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _grid_pad(c, size, padding_mode, align_corners):
    if padding_mode == 1:
        return _grid_clip(c, size)
    if padding_mode == 2:
        c = _grid_reflect(c, 0, 2 * (size - 1)) if align_corners else _grid_reflect(c, -1, 2 * size - 1)
        return _grid_clip(c, size)
    return c


def _grid_unnormalize(c, size, align_corners):
    if align_corners:
        return _mul((c + 1) / 2, size - 1)
    return (_mul(c + 1, size) - 1) / 2


def _grid_gather(x, *coords):
    """x[n, :, *coords] for every grid point (zero where out of bounds), as (N, C, *grid), and
    where the point was in bounds, as (N, 1, *grid). ``coords`` are integer arrays
    (N, *grid), one per spatial dim of ``x`` in its order (depth, height, width)."""
    sizes = x.shape[2:]
    valid = functools.reduce(jnp.logical_and, [(c >= 0) & (c < n) for c, n in zip(coords, sizes)])
    batch = np.arange(x.shape[0]).reshape((-1,) + (1,) * (coords[0].ndim - 1))
    v = x[(batch, slice(None)) + tuple(jnp.clip(c, 0, n - 1) for c, n in zip(coords, sizes))]
    return jnp.moveaxis(jnp.where(valid[..., None], v, jnp.zeros((), x.dtype)), -1, 1), valid[:, None]


def _grid_coords(x, grid, padding_mode, align_corners):
    """The grid's sampling positions in pixels, padded, one array per spatial dim of ``x``
    in its order (the grid's last axis lists them from the width on)."""
    sizes = x.shape[2:]
    return [_grid_pad(_grid_unnormalize(grid[..., k].astype(x.dtype), n, align_corners), n, padding_mode,
                      align_corners)
            for k, n in zip(range(len(sizes) - 1, -1, -1), sizes)]


def _grid_index(c):
    """Integer pixel coordinates ``c`` (floored, rounded) as torch's int64 cast makes them: NaN
    becomes the lowest int64 (out of bounds), where XLA's conversion would give 0."""
    return jnp.where(jnp.isnan(c), np.iinfo(np.int64).min, c.astype(np.int64))


def _grid_nearest(x, coords):
    """Nearest sampling, ties to even as std::nearbyint."""
    return _grid_gather(x, *(_grid_index(jnp.round(c)) for c in coords))[0]


def _grid_linear(x, coords):
    """(Bi/tri)linear sampling as torch's kernels sum it: corners in the order of their
    offsets (width fastest), each weighted by the product of its per-axis weights taken
    from the width axis on; corners out of bounds add zero."""
    low = [_grid_index(jnp.floor(c)) for c in coords]
    out = jnp.zeros((x.shape[0], x.shape[1]) + coords[0].shape[1:], x.dtype)
    for offsets in itertools.product((0, 1), repeat=len(coords)):
        corner = [lo + o for lo, o in zip(low, offsets)]
        factors = [(lo + 1).astype(x.dtype) - c if o == 0 else c - lo.astype(x.dtype)
                   for lo, c, o in zip(low, coords, offsets)]
        weight = functools.reduce(jnp.multiply, factors[::-1])
        # a corner out of bounds reads 0 (times a NaN coordinate's weight: NaN, as torch's kernel) and
        # gets no gradient
        v, _ = _grid_gather(x, *corner)
        out = out + _mul(v, weight[:, None])
    return out


def _cubic_coeffs(t):
    a = jnp.asarray(-0.75, t.dtype)
    return _cubic_far(t + 1, a), _cubic_near(t, a), _cubic_near(1 - t, a), _cubic_far((1 - t) + 1, a)


def _cubic_interp(v, t):
    c = _cubic_coeffs(t)
    return _mul(v[0], c[0]) + _mul(v[1], c[1]) + _mul(v[2], c[2]) + _mul(v[3], c[3])


def _check_grid_sampler(x, grid, dims):
    """torch's checks of grid_sampler's arguments, in its order."""
    if grid.dtype != x.dtype:
        raise RuntimeError(f"expected scalar type {scalar_type_name(x.dtype)} but found {scalar_type_name(grid.dtype)}")
    given = f"input with sizes {list(x.shape)} and grid with sizes {list(grid.shape)}"
    if x.shape[0] != grid.shape[0]:
        raise RuntimeError(f"grid_sampler(): expected grid and input to have same batch size, but got {given}")
    if grid.shape[-1] != x.ndim - 2:
        raise RuntimeError(f"grid_sampler(): expected grid to have size {x.ndim - 2} in last dimension, but got grid "
                           f"with sizes {list(grid.shape)}")
    for d in range(2, x.ndim):
        if x.shape[d] == 0:
            raise RuntimeError("grid_sampler(): expected input to have non-empty spatial dimensions, but input has "
                               f"sizes {list(x.shape)} with dimension {d} being empty")
    if x.ndim != dims or grid.ndim != dims:
        raise RuntimeError(f"grid_sampler(): expected {dims}D input and grid with same number of dimensions, but got "
                           f"{given}")


refused_dtypes(aten.grid_sampler_2d, aten.grid_sampler_3d, kinds="bic")  # (torch's CPU kernels are floating only)
op_by_op(aten.grid_sampler_2d, aten.grid_sampler_3d)  # (float16 coordinates rounded step by step, as torch)


@register(aten.grid_sampler_2d.default)
def grid_sampler_2d(x, grid, interpolation_mode, padding_mode, align_corners):
    _check_grid_sampler(x, grid, 4)
    if interpolation_mode == 2:  # bicubic: taps are padded one by one
        h, w = x.shape[2:]
        gx, gy = grid[..., 0].astype(x.dtype), grid[..., 1].astype(x.dtype)
        ix, iy = _grid_unnormalize(gx, w, align_corners), _grid_unnormalize(gy, h, align_corners)
        ix0, iy0 = jnp.floor(ix), jnp.floor(iy)
        tx, ty = (ix - ix0)[:, None], (iy - iy0)[:, None]

        def value(cx, cy):
            cx = _grid_pad(cx, w, padding_mode, align_corners)
            cy = _grid_pad(cy, h, padding_mode, align_corners)
            return _grid_gather(x, _grid_index(jnp.trunc(cy)), _grid_index(jnp.trunc(cx)))[0]

        rows = [_cubic_interp([value(ix0 + (j - 1), iy0 + (i - 1)) for j in range(4)], tx) for i in range(4)]
        return _cubic_interp(rows, ty)
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


def _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners):
    """Linear (0) or nearest (1) grid sampling of a 4-D or 5-D input."""
    coords = _grid_coords(x, grid, padding_mode, align_corners)
    return _grid_nearest(x, coords) if interpolation_mode == 1 else _grid_linear(x, coords)


def _grid_sampler_backward(forward, grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    gx, ggrid = _vjp(lambda a, g: forward(a, g, interpolation_mode, padding_mode, align_corners), (x, grid), grad)
    return gx if output_mask[0] else None, ggrid.astype(grid.dtype)


@register(aten.grid_sampler_2d_backward.default)
def grid_sampler_2d_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    return _grid_sampler_backward(grid_sampler_2d, grad, x, grid, interpolation_mode, padding_mode, align_corners,
                                  output_mask)


@register(aten.grid_sampler_3d.default)
def grid_sampler_3d(x, grid, interpolation_mode, padding_mode, align_corners):
    _check_grid_sampler(x, grid, 5)
    if interpolation_mode == 2:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


@register(aten.grid_sampler_3d_backward.default)
def grid_sampler_3d_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    return _grid_sampler_backward(grid_sampler_3d, grad, x, grid, interpolation_mode, padding_mode, align_corners,
                                  output_mask)


# -- padding ------------------------------------------------------------------------


def _pad_index(size, lo, hi, mode):
    """Input index of each output position along one dim (negative pads crop)."""
    j = np.arange(size + lo + hi) - lo
    if mode == "reflect":
        if max(lo, hi) >= size:
            raise RuntimeError(
                f"Argument #4: Padding size should be less than the corresponding input dimension, but got: "
                f"padding ({lo}, {hi}) at dimension of size {size}"
            )
        j = np.abs(j)
        return np.where(j >= size, 2 * (size - 1) - j, j)
    if size == 0 and j.size:
        raise RuntimeError("padding: input dimension is empty but the output is not")
    return np.clip(j, 0, size - 1)


def _pad(x, padding, mode):
    """reflect / replicate padding of the trailing len(padding) // 2 dims (last dim first in ``padding``)."""
    n = len(padding) // 2
    for i in range(n):
        ax = x.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        if lo or hi:
            x = jnp.take(x, _pad_index(x.shape[ax], lo, hi, mode), axis=ax)
    return x


def _check_pad_input(x, n):
    """torch's check of a reflection / replication pad's input (before the pads' own): no empty dim, but a
    batch's first (the meta kernel words it otherwise, and JAX would pad the empty dims)."""
    dims = x.shape[1:] if x.ndim == n + 2 else x.shape
    if 0 in dims:
        raise TorchRuntimeError(f"Expected {n + 1}D or {n + 2}D (batch mode) tensor with possibly 0 batch size and "
                                f"other non-zero dimensions for input, but got: {list(x.shape)}")


def _register_pad(op, mode, n):
    def lowering(x, padding):
        _check_pad_input(x, n)
        return _pad(x, padding, mode)

    def backward(grad, x, padding):
        return _vjp(lambda a: lowering(a, padding), (x,), grad)[0]

    register(getattr(aten, op).default)(lowering)
    register(getattr(aten, op + "_backward").default)(backward)


# torch's CPU reflection / replication pads copy numbers, not bools
refused_dtypes(*(getattr(aten, f"{name}{n}d") for name in ("reflection_pad", "replication_pad") for n in (1, 2, 3)),
               kinds="b")
for _n in (1, 2, 3):
    _register_pad(f"reflection_pad{_n}d", "reflect", _n)
    _register_pad(f"replication_pad{_n}d", "edge", _n)


# -- im2col / col2im -------------------------------------------------------------------


def _im2col(x, kernel_size, dilation, padding, stride):
    k, d, p, s = (_tuple(v, 2) for v in (kernel_size, dilation, padding, stride))
    geometry = [_sliding(x.shape[x.ndim - 2 + i], k[i], s[i], p[i], d[i], False) for i in range(2)]
    patches, valid, _ = _windows(x, geometry)
    patches = jnp.where(valid, patches, jnp.zeros((), x.dtype))  # [..., C, oh, ow, kh*kw]
    lead = patches.shape[:-4]
    c, oh, ow, kk = patches.shape[-4:]
    cols = jnp.moveaxis(patches, -1, -3)  # [..., C, K, oh, ow]
    return cols.reshape(lead + (c * kk, oh * ow))


refused_dtypes(aten.im2col, aten.col2im, kinds="i")  # (torch's CPU kernels: floating, complex and bool only)


def _check_unbatched_or_batch(x, ranks, message):
    """torch CPU's im2col / col2im input check: rank ``ranks[0]`` with no empty dim, or ``ranks[1]`` (batched)
    with only the batch empty; ``message`` in the kernel's words (its meta kernel's differ)."""
    if not ((x.ndim == ranks[0] and 0 not in x.shape) or (x.ndim == ranks[1] and 0 not in x.shape[1:])):
        raise TorchRuntimeError(f"{message}, but got: {list(x.shape)}")


@register(aten.im2col.default)
def im2col(x, kernel_size, dilation, padding, stride):
    _check_unbatched_or_batch(x, (3, 4), "Expected 3D or 4D (batch mode) tensor with possibly 0 batch size and "
                                         "other non-zero dimensions for input")
    return _im2col(x, kernel_size, dilation, padding, stride)


@register(aten.col2im.default)
def col2im(x, output_size, kernel_size, dilation, padding, stride):
    _check_unbatched_or_batch(x, (2, 3), "Expected 2D or 3D (batch mode) tensor for input with possibly 0 batch "
                                         "size and non-zero dimensions for input")
    k = _tuple(kernel_size, 2)
    c = x.shape[-2] // (k[0] * k[1])
    shape = x.shape[:-2] + (c,) + tuple(_tuple(output_size, 2))
    fwd = lambda a: _im2col(a, kernel_size, dilation, padding, stride)  # noqa: E731
    return _linear_backward(fwd, shape, x.dtype, x)
