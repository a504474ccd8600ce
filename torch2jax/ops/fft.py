"""Lowerings: the three FFT primitives every ``torch.fft`` function reaches.

``normalization`` is torch's fft_norm_mode: 0 = none, 1 = 1/sqrt(n), 2 = 1/n,
where n is the number of points of the signal (the output sizes for c2r). The
transforms themselves run unnormalized and the scale is applied afterwards.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes as _dt
from .registry import canonical_dims, register

aten = torch.ops.aten


def _normalize(out, n, normalization):
    if normalization == 1:
        return out * np.asarray(1 / math.sqrt(n), _dt.real_of(out.dtype))
    if normalization == 2:
        return out * np.asarray(1 / n, _dt.real_of(out.dtype))
    return out


def _check_dtype(name, x):
    if np.dtype(x.dtype) in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        raise RuntimeError(f"{name}: unsupported dtype {_dt.to_torch(x.dtype)} (torch CPU has no half-precision FFT)")


@register(aten._fft_r2c.default)
def _fft_r2c(x, dim, normalization, onesided):
    _check_dtype("_fft_r2c", x)
    axes = canonical_dims(dim, x.ndim)
    n = math.prod(x.shape[a] for a in axes)
    if onesided:
        out = jnp.fft.rfftn(x, axes=axes)
    else:
        out = jnp.fft.fftn(x.astype(_dt.complex_of(x.dtype)), axes=axes)
    return _normalize(out.astype(_dt.complex_of(x.dtype)), n, normalization)


@register(aten._fft_c2r.default)
def _fft_c2r(x, dim, normalization, last_dim_size):
    _check_dtype("_fft_c2r", x)
    axes = canonical_dims(dim, x.ndim)
    sizes = [x.shape[a] for a in axes[:-1]] + [last_dim_size]
    out = jnp.fft.irfftn(x, s=sizes, axes=axes, norm="forward")
    return _normalize(out.astype(_dt.real_of(x.dtype)), math.prod(sizes), normalization)


@register(aten._fft_c2c.default)
def _fft_c2c(x, dim, normalization, forward):
    _check_dtype("_fft_c2c", x)
    axes = canonical_dims(dim, x.ndim)
    if not axes:
        return _normalize(x, 1, normalization)
    n = math.prod(x.shape[a] for a in axes)
    out = jnp.fft.fftn(x, axes=axes) if forward else jnp.fft.ifftn(x, axes=axes, norm="forward")
    return _normalize(out.astype(x.dtype), n, normalization)
