"""Lowerings: torchvision's custom ops (``torch.ops.torchvision.*``).

Loaded by `torch2jax.ops.load_namespace` the first time a ``torchvision::`` op reaches
dispatch, so torch2jax never imports torchvision itself and works without it.

The RoI ops sample with bilinear weights that are separable in y and x, so each RoI's
pooling is two small matrix products (rows, then columns) instead of a gather per sample
point. Their ``_*_backward`` ops, which torchvision's autograd formulas call, are the VJPs
of these same lowerings, so gradients agree with the forward by construction.
``nms`` keeps a data-dependent number of boxes: the suppression runs in JAX, only the
final compaction needs concrete values, so like ``nonzero`` it runs eagerly only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .indexing import _concrete, _traced
from .registry import register

tv = torch.ops.torchvision

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)


def _op_error(msg):
    from ..dispatch import OpError

    return OpError(f"torch2jax: torchvision::{msg}")


# -- nms ------------------------------------------------------------------------------------


@register(tv.nms)
def nms(dets, scores, iou_threshold):
    if dets.shape[0] == 0:
        return jnp.zeros((0,), _I64)
    order = jnp.argsort(-scores, stable=True)
    boxes = dets[order]
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    area = (x2 - x1) * (y2 - y1)

    def body(i, removed):
        # torchvision's formula and order of operations, so ties at the threshold agree
        w = jnp.maximum(jnp.minimum(x2[i], x2) - jnp.maximum(x1[i], x1), 0)
        h = jnp.maximum(jnp.minimum(y2[i], y2) - jnp.maximum(y1[i], y1), 0)
        inter = w * h
        iou = inter / (area[i] + area - inter)
        later = jnp.arange(removed.shape[0]) > i
        return removed | (~removed[i] & later & (iou > iou_threshold))

    removed = jax.lax.fori_loop(0, boxes.shape[0], body, jnp.zeros(boxes.shape[0], bool))
    keep, order = _concrete("torchvision::nms", ~removed, order)
    return jnp.asarray(order[keep], _I64)


# -- RoI align family -----------------------------------------------------------------------


def _interp_matrix(start, bin_size, n_bins, grid, n_grid, size, dtype):
    """(K, n_bins, size): row p averages the bilinear weights of bin p's ``n_grid`` samples.

    ``grid`` is the static number of sample slots; slots past a RoI's own ``n_grid`` are
    masked off (``sampling_ratio=0`` gives each RoI its own count).
    """
    slot = jnp.arange(grid, dtype=dtype)
    pos = (start[:, None, None] + jnp.arange(n_bins, dtype=dtype)[None, :, None] * bin_size[:, None, None]
           + (slot[None, None, :] + 0.5) * bin_size[:, None, None] / n_grid[:, None, None])
    used = slot[None, None, :] < n_grid[:, None, None]
    inside = (pos >= -1.0) & (pos <= size)
    pos = jnp.maximum(pos, 0.0)
    low = jnp.floor(pos).astype(_I32)
    at_edge = low >= size - 1
    low = jnp.where(at_edge, size - 1, low)
    high = jnp.where(at_edge, size - 1, low + 1)
    pos = jnp.where(at_edge, low.astype(dtype), pos)
    frac = pos - low
    keep = (used & inside).astype(dtype)
    cells = jnp.arange(size)
    weights = (((1 - frac) * keep)[..., None] * (low[..., None] == cells)
               + (frac * keep)[..., None] * (high[..., None] == cells))
    return weights.sum(2)


def _roi_grid(rois, spatial_scale, ph, pw, sampling_ratio, aligned, dtype):
    offset = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (rois[:, i].astype(dtype) * spatial_scale - offset for i in range(1, 5))
    rw, rh = x2 - x1, y2 - y1
    if aligned is False:
        rw, rh = jnp.maximum(rw, 1.0), jnp.maximum(rh, 1.0)
    bh, bw = rh / ph, rw / pw
    if sampling_ratio > 0:
        gh = gw = sampling_ratio
        nh = jnp.full(rh.shape, sampling_ratio, dtype)
        nw = jnp.full(rw.shape, sampling_ratio, dtype)
    else:
        nh, nw = jnp.ceil(rh / ph), jnp.ceil(rw / pw)
        if _traced(nh, nw):
            raise _op_error(
                "roi_align with sampling_ratio <= 0 samples each RoI a data-dependent number of times, "
                "so it cannot run under jax.jit; pass sampling_ratio > 0"
            )
        gh, gw = (max(int(np.max(np.asarray(n), initial=0)), 1) for n in (nh, nw))
    return y1, x1, bh, bw, nh, nw, gh, gw


def _roi_pool_avg(x, rois, spatial_scale, ph, pw, sampling_ratio, aligned):
    """(K, C, ph, pw) RoIAlign averages; ``aligned=None`` is the position-sensitive variant
    (half-pixel offset, no minimum RoI size)."""
    dtype = x.dtype
    _, _, height, width = x.shape
    y1, x1, bh, bw, nh, nw, gh, gw = _roi_grid(rois, spatial_scale, ph, pw, sampling_ratio,
                                                True if aligned is None else aligned, dtype)
    ay = _interp_matrix(y1, bh, ph, gh, nh, height, dtype)
    ax = _interp_matrix(x1, bw, pw, gw, nw, width, dtype)
    count = jnp.maximum(nh * nw, 1.0)
    batch = rois[:, 0].astype(_I32)
    out = jnp.zeros((rois.shape[0], x.shape[1], ph, pw), dtype)
    for n in range(x.shape[0]):
        rows = ay * (batch == n)[:, None, None]
        out = out + jnp.einsum("kph,chw,kqw->kcpq", rows, x[n], ax, precision="highest")
    return out / count[:, None, None, None]


@register(tv.roi_align)
def roi_align(x, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    return _roi_pool_avg(x, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, bool(aligned))


def _input_vjp(forward, grad, shape):
    zeros = jnp.zeros(shape, grad.dtype)
    _, vjp = jax.vjp(forward, zeros)
    return vjp(grad)[0]


@register(tv._roi_align_backward)
def roi_align_backward(grad, rois, spatial_scale, ph, pw, batch_size, channels, height, width, sampling_ratio,
                       aligned):
    return _input_vjp(lambda x: roi_align(x, rois, spatial_scale, ph, pw, sampling_ratio, aligned),
                      grad, (batch_size, channels, height, width))


def _ps_channels(c_in, ph, pw):
    c_out = c_in // (ph * pw)
    return (jnp.arange(c_out)[:, None, None] * ph + jnp.arange(ph)[:, None]) * pw + jnp.arange(pw)


@register(tv.ps_roi_align)
def ps_roi_align(x, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio):
    out = _ps_roi_align_values(x, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio)
    mapping = jnp.broadcast_to(_ps_channels(x.shape[1], pooled_height, pooled_width), out.shape)
    return out, mapping.astype(_I32)


def _ps_roi_align_values(x, rois, spatial_scale, ph, pw, sampling_ratio):
    full = _roi_pool_avg(x, rois, spatial_scale, ph, pw, sampling_ratio, None)
    idx = _ps_channels(x.shape[1], ph, pw)
    return full[:, idx, jnp.arange(ph)[:, None], jnp.arange(pw)]


@register(tv._ps_roi_align_backward)
def ps_roi_align_backward(grad, rois, channel_mapping, spatial_scale, ph, pw, sampling_ratio, batch_size,
                          channels, height, width):
    return _input_vjp(lambda x: _ps_roi_align_values(x, rois, spatial_scale, ph, pw, sampling_ratio),
                      grad, (batch_size, channels, height, width))


# -- RoI max / average pooling over integer bins ----------------------------------------------


def _round_half_away(v):
    return jnp.sign(v) * jnp.floor(jnp.abs(v) + 0.5)


def _bin_masks(start, extent, n_bins, size, dtype):
    """(K, n_bins, size) membership of each cell in each integer bin, and the bins' emptiness."""
    bin_size = extent.astype(dtype) / n_bins
    p = jnp.arange(n_bins, dtype=dtype)
    lo = jnp.clip(jnp.floor(p * bin_size[:, None]).astype(_I32) + start[:, None], 0, size)
    hi = jnp.clip(jnp.ceil((p + 1) * bin_size[:, None]).astype(_I32) + start[:, None], 0, size)
    cells = jnp.arange(size)
    return (cells >= lo[..., None]) & (cells < hi[..., None]), hi <= lo


def _int_bins(x, rois, spatial_scale, ph, pw, plus_one):
    coords = _round_half_away(rois[:, 1:5] * spatial_scale).astype(_I32)
    x1, y1, x2, y2 = coords[:, 0], coords[:, 1], coords[:, 2], coords[:, 3]
    extra = 1 if plus_one else 0
    my, empty_y = _bin_masks(y1, jnp.maximum(y2 - y1 + extra, 1), ph, x.shape[2], x.dtype)
    mx, empty_x = _bin_masks(x1, jnp.maximum(x2 - x1 + extra, 1), pw, x.shape[3], x.dtype)
    empty = empty_y[:, :, None] | empty_x[:, None, :]
    return my, mx, empty, rois[:, 0].astype(_I32)


@register(tv.roi_pool)
def roi_pool(x, rois, spatial_scale, pooled_height, pooled_width):
    my, mx, empty, batch = _int_bins(x, rois, spatial_scale, pooled_height, pooled_width, True)
    feats = x[batch]  # (K, C, H, W)
    low = jnp.array(-jnp.inf, x.dtype)
    # max over each bin's columns, then its rows; argmax keeps the first maximum in
    # row-major order, as torchvision's scan does
    by_col = jnp.where(mx[:, None, :, None, :], feats[:, :, None, :, :], low)  # K,C,pw,H,W
    col_val, col_arg = by_col.max(-1), by_col.argmax(-1)  # K,C,pw,H
    by_row = jnp.where(my[:, None, :, None, :], col_val[:, :, None, :, :], low)  # K,C,ph,pw,H
    val, row = by_row.max(-1), by_row.argmax(-1)
    col = jnp.take_along_axis(col_arg[:, :, None], row[..., None], axis=-1)[..., 0]
    arg = row * x.shape[3] + col
    empty = empty[:, None]
    return jnp.where(empty, 0, val).astype(x.dtype), jnp.where(empty, -1, arg).astype(_I32)


@register(tv._roi_pool_backward)
def roi_pool_backward(grad, rois, argmax, spatial_scale, ph, pw, batch_size, channels, height, width):
    k, c = grad.shape[:2]
    batch = jnp.broadcast_to(rois[:, 0].astype(_I32)[:, None, None, None], argmax.shape)
    chan = jnp.broadcast_to(jnp.arange(c)[None, :, None, None], argmax.shape)
    valid = argmax >= 0
    flat = jnp.zeros((batch_size, channels, height * width), grad.dtype)
    flat = flat.at[batch, chan, jnp.where(valid, argmax, 0)].add(jnp.where(valid, grad, 0))
    return flat.reshape(batch_size, channels, height, width)


def _ps_roi_pool_values(x, rois, spatial_scale, ph, pw):
    my, mx, empty, batch = _int_bins(x, rois, spatial_scale, ph, pw, False)
    dtype = x.dtype
    idx = _ps_channels(x.shape[1], ph, pw)  # (C_out, ph, pw)
    feats = x[batch]  # K,C,H,W
    sums = jnp.einsum("kph,kchw,kqw->kcpq", my.astype(dtype), feats, mx.astype(dtype), precision="highest")
    area = my.sum(-1).astype(dtype)[:, :, None] * mx.sum(-1).astype(dtype)[:, None, :]
    sel = sums[:, idx, jnp.arange(ph)[:, None], jnp.arange(pw)]  # K,C_out,ph,pw
    area = area[:, None]
    return jnp.where(empty[:, None], 0, sel / jnp.where(area > 0, area, 1))


@register(tv.ps_roi_pool)
def ps_roi_pool(x, rois, spatial_scale, pooled_height, pooled_width):
    out = _ps_roi_pool_values(x, rois, spatial_scale, pooled_height, pooled_width)
    mapping = jnp.broadcast_to(_ps_channels(x.shape[1], pooled_height, pooled_width), out.shape)
    return out, mapping.astype(_I32)


@register(tv._ps_roi_pool_backward)
def ps_roi_pool_backward(grad, rois, channel_mapping, spatial_scale, ph, pw, batch_size, channels, height, width):
    return _input_vjp(lambda x: _ps_roi_pool_values(x, rois, spatial_scale, ph, pw),
                      grad, (batch_size, channels, height, width))


# -- deformable convolution -----------------------------------------------------------------


def _deform_conv2d(x, weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups,
                   offset_groups, use_mask):
    n, c_in, height, width = x.shape
    c_out, _, kh, kw = weight.shape
    oh, ow = offset.shape[2], offset.shape[3]
    taps = kh * kw
    cpg = c_in // offset_groups
    dtype = x.dtype
    off = offset.reshape(n, offset_groups, taps, 2, oh, ow)
    ki = jnp.repeat(jnp.arange(kh), kw)[:, None, None]
    kj = jnp.tile(jnp.arange(kw), kh)[:, None, None]
    base_y = (jnp.arange(oh)[:, None] * stride_h - pad_h + ki * dil_h).astype(dtype)  # taps,oh,1
    base_x = (jnp.arange(ow)[None, :] * stride_w - pad_w + kj * dil_w).astype(dtype)  # taps,1,ow
    py = base_y + off[:, :, :, 0]  # n,og,taps,oh,ow
    px = base_x + off[:, :, :, 1]
    inside = (py > -1) & (py < height) & (px > -1) & (px < width)
    y0, x0 = jnp.floor(py), jnp.floor(px)
    ly, lx = py - y0, px - x0
    y0, x0 = y0.astype(_I32), x0.astype(_I32)
    planes = x.reshape(n, offset_groups, cpg, height * width)
    cols = jnp.zeros((n, offset_groups, cpg) + py.shape[2:], dtype)
    for dy, wy in ((0, 1 - ly), (1, ly)):
        for dx, wx in ((0, 1 - lx), (1, lx)):
            yy, xx = y0 + dy, x0 + dx
            ok = inside & (yy >= 0) & (yy < height) & (xx >= 0) & (xx < width)
            flat = jnp.where(ok, yy * width + xx, 0).reshape(n, offset_groups, 1, -1)
            got = jnp.take_along_axis(planes, flat, axis=-1).reshape(cols.shape)
            cols = cols + (jnp.where(ok, wy * wx, 0))[:, :, None] * got
    if use_mask:
        cols = cols * mask.reshape(n, offset_groups, 1, taps, oh, ow)
    cols = cols.reshape(n, groups, c_in // groups * taps, oh * ow)
    w = weight.reshape(groups, c_out // groups, -1)
    out = jnp.einsum("gok,ngkp->ngop", w, cols, precision="highest").reshape(n, c_out, oh, ow)
    return out + bias.reshape(1, -1, 1, 1)


@register(tv.deform_conv2d)
def deform_conv2d(x, weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups,
                  offset_groups, use_mask):
    return _deform_conv2d(x, weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups,
                          offset_groups, use_mask)


@register(tv._deform_conv2d_backward)
def deform_conv2d_backward(grad, x, weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                           groups, offset_groups, use_mask):
    def forward(x, weight, offset, mask, bias):
        return _deform_conv2d(x, weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                              groups, offset_groups, use_mask)

    _, vjp = jax.vjp(forward, x, weight, offset, mask, bias)
    grads = vjp(grad)
    if not use_mask:
        grads = grads[:3] + (jnp.zeros_like(mask),) + grads[4:]
    return grads

