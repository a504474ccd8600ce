"""Import torchvision for the tests, with CPU reference kernels when its C++ ops cannot load.

The torchvision wheel on PyPI is built against CUDA torch; next to the CPU build of torch
that CI installs its ``_C`` extension fails to load, and ``import torchvision`` then fails
outright (its fake-kernel registrations expect the ``torchvision::`` ops to exist). In that
case the ops are declared here with their upstream schemas and given plain-torch CPU
kernels, written for clarity rather than speed, to serve as the oracle the jax lowerings
are compared against. With a working extension nothing is replaced and torchvision's own
kernels are the oracle.
"""

from __future__ import annotations

import importlib
import math

import torch

HAS_NATIVE_OPS = False
_lib = None


def import_torchvision():
    global HAS_NATIVE_OPS
    try:
        import torchvision

        HAS_NATIVE_OPS = torchvision.extension._has_ops()
        return torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    _define_reference_ops()
    import torchvision
    import torchvision.extension

    # Upstream registers autograd only when its extension loaded; the reference kernels
    # stand in for it, so the same registrations apply.
    import sys

    for name, module in list(sys.modules.items()):
        if name.startswith("torchvision") and hasattr(module, "_has_ops"):
            module._has_ops = _has_ops
    torchvision.extension._has_ops = _has_ops
    importlib.reload(torchvision._autograd_registrations)
    return torchvision


def _has_ops():
    return True


_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward": "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "roi_pool": "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward": "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "ps_roi_align": "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward": "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
    "float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, "
    "SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool": "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward": "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
    "float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "deform_conv2d": "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward": "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, "
    "Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
    "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "qroi_align": "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, "
    "float rois_scale, int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
}


def _define_reference_ops():
    global _lib
    _lib = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS.values():
        _lib.define(schema)
    for name, fn in _KERNELS.items():
        _lib.impl(name, fn, "CPU")


# -- reference kernels (loops over boxes and bins, as the definitions read) ----------------


def _nms(boxes, scores, iou_threshold):
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    b = boxes.double().tolist()
    keep, removed = [], set()
    for i in order:
        if i in removed:
            continue
        keep.append(i)
        x1, y1, x2, y2 = b[i]
        for j in order:
            if j in removed or j == i:
                continue
            u1, v1, u2, v2 = b[j]
            w = max(0.0, min(x2, u2) - max(x1, u1))
            h = max(0.0, min(y2, v2) - max(y1, v1))
            inter = w * h
            union = (x2 - x1) * (y2 - y1) + (u2 - u1) * (v2 - v1) - inter
            # as in C: 0/0 for two empty boxes is NaN, which suppresses nothing
            if union != 0 and inter / union > iou_threshold:
                removed.add(j)
    return torch.tensor(keep, dtype=torch.long)


def _bilinear(plane, y, x):
    """torchvision's sampling rule: zero outside [-1, size], edges clamped inside."""
    height, width = plane.shape[-2:]
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return plane.new_zeros(plane.shape[:-2])
    y, x = max(y, 0.0), max(x, 0.0)
    y0, x0 = int(y), int(x)
    if y0 >= height - 1:
        y0 = y1 = height - 1
        y = float(y0)
    else:
        y1 = y0 + 1
    if x0 >= width - 1:
        x0 = x1 = width - 1
        x = float(x0)
    else:
        x1 = x0 + 1
    ly, lx = y - y0, x - x0
    hy, hx = 1.0 - ly, 1.0 - lx
    return (hy * hx * plane[..., y0, x0] + hy * lx * plane[..., y0, x1]
            + ly * hx * plane[..., y1, x0] + ly * lx * plane[..., y1, x1])


def _roi_geometry(roi, spatial_scale, ph, pw, offset):
    x1, y1, x2, y2 = (float(v) * spatial_scale - offset for v in roi[1:])
    return int(roi[0]), y1, x1, y2 - y1, x2 - x1


def _roi_align(input, rois, spatial_scale, ph, pw, sampling_ratio, aligned):
    # (torchvision's pure-torch _roi_align is no oracle: it does not zero samples beyond
    # the far edge as its C++ kernels do)
    out = input.new_zeros((rois.shape[0], input.shape[1], ph, pw))
    for k, roi in enumerate(rois):
        b, y1, x1, rh, rw = _roi_geometry(roi, spatial_scale, ph, pw, 0.5 if aligned else 0.0)
        if not aligned:
            rh, rw = max(rh, 1.0), max(rw, 1.0)
        bh, bw = rh / ph, rw / pw
        gh = sampling_ratio if sampling_ratio > 0 else math.ceil(rh / ph)
        gw = sampling_ratio if sampling_ratio > 0 else math.ceil(rw / pw)
        count = max(gh * gw, 1)
        for i in range(ph):
            for j in range(pw):
                acc = input.new_zeros(input.shape[1])
                for iy in range(gh):
                    for ix in range(gw):
                        y = y1 + i * bh + (iy + 0.5) * bh / gh
                        x = x1 + j * bw + (ix + 0.5) * bw / gw
                        acc = acc + _bilinear(input[b], y, x)
                out[k, :, i, j] = acc / count
    return out


def _roi_align_backward(grad, rois, spatial_scale, ph, pw, n, c, h, w, sampling_ratio, aligned):
    # roi_align is linear in its input: each sample hands its share of the bin's gradient
    # to the cells its bilinear weights came from (autograd is off inside a kernel)
    out = grad.new_zeros((n, c, h, w))
    for k, roi in enumerate(rois):
        b, y1, x1, rh, rw = _roi_geometry(roi, spatial_scale, ph, pw, 0.5 if aligned else 0.0)
        if not aligned:
            rh, rw = max(rh, 1.0), max(rw, 1.0)
        bh, bw = rh / ph, rw / pw
        gh = sampling_ratio if sampling_ratio > 0 else math.ceil(rh / ph)
        gw = sampling_ratio if sampling_ratio > 0 else math.ceil(rw / pw)
        count = max(gh * gw, 1)
        for i in range(ph):
            for j in range(pw):
                for iy in range(gh):
                    for ix in range(gw):
                        y = y1 + i * bh + (iy + 0.5) * bh / gh
                        x = x1 + j * bw + (ix + 0.5) * bw / gw
                        for (yy, xx), wt in _bilinear_weights(h, w, y, x):
                            out[b, :, yy, xx] += grad[k, :, i, j] * (wt / count)
    return out


def _bilinear_weights(height, width, y, x):
    """The (cell, weight) pairs of `_bilinear`."""
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return []
    y, x = max(y, 0.0), max(x, 0.0)
    y0, x0 = int(y), int(x)
    if y0 >= height - 1:
        y0 = y1 = height - 1
        y = float(y0)
    else:
        y1 = y0 + 1
    if x0 >= width - 1:
        x0 = x1 = width - 1
        x = float(x0)
    else:
        x1 = x0 + 1
    ly, lx = y - y0, x - x0
    return [((y0, x0), (1 - ly) * (1 - lx)), ((y0, x1), (1 - ly) * lx), ((y1, x0), ly * (1 - lx)), ((y1, x1), ly * lx)]


def _roi_pool(input, rois, spatial_scale, ph, pw):
    k_, c, h, w = rois.shape[0], input.shape[1], input.shape[2], input.shape[3]
    out = input.new_zeros((k_, c, ph, pw))
    argmax = torch.full((k_, c, ph, pw), -1, dtype=torch.int32)
    for k, roi in enumerate(rois):
        b = int(roi[0])
        # C's round(): halves away from zero, not to even
        x1, y1, x2, y2 = (int(math.copysign(math.floor(abs(float(v) * spatial_scale) + 0.5), v)) for v in roi[1:])
        rh, rw = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for i in range(ph):
            for j in range(pw):
                hs = min(max(math.floor(i * rh / ph) + y1, 0), h)
                he = min(max(math.ceil((i + 1) * rh / ph) + y1, 0), h)
                ws = min(max(math.floor(j * rw / pw) + x1, 0), w)
                we = min(max(math.ceil((j + 1) * rw / pw) + x1, 0), w)
                if he <= hs or we <= ws:
                    continue
                region = input[b, :, hs:he, ws:we].reshape(c, -1)
                val, idx = region.max(dim=1)
                out[k, :, i, j] = val
                argmax[k, :, i, j] = ((idx // (we - ws) + hs) * w + idx % (we - ws) + ws).int()
    return out, argmax


def _ps_roi_pool(input, rois, spatial_scale, ph, pw):
    c_out, h, w = input.shape[1] // (ph * pw), input.shape[2], input.shape[3]
    out = input.new_zeros((rois.shape[0], c_out, ph, pw))
    mapping = torch.zeros(out.shape, dtype=torch.int32)
    for k, roi in enumerate(rois):
        b = int(roi[0])
        x1, y1, x2, y2 = (int(math.copysign(math.floor(abs(float(v) * spatial_scale) + 0.5), v)) for v in roi[1:])
        rh, rw = max(y2 - y1, 1), max(x2 - x1, 1)
        for co in range(c_out):
            for i in range(ph):
                for j in range(pw):
                    hs = min(max(math.floor(i * rh / ph) + y1, 0), h)
                    he = min(max(math.ceil((i + 1) * rh / ph) + y1, 0), h)
                    ws = min(max(math.floor(j * rw / pw) + x1, 0), w)
                    we = min(max(math.ceil((j + 1) * rw / pw) + x1, 0), w)
                    ci = (co * ph + i) * pw + j
                    mapping[k, co, i, j] = ci
                    if he > hs and we > ws:
                        out[k, co, i, j] = input[b, ci, hs:he, ws:we].sum() / ((he - hs) * (we - ws))
    return out, mapping


def _ps_roi_align(input, rois, spatial_scale, ph, pw, sampling_ratio):
    c_out = input.shape[1] // (ph * pw)
    out = input.new_zeros((rois.shape[0], c_out, ph, pw))
    mapping = torch.zeros(out.shape, dtype=torch.int32)
    for k, roi in enumerate(rois):
        b, y1, x1, rh, rw = _roi_geometry(roi, spatial_scale, ph, pw, 0.5)
        bh, bw = rh / ph, rw / pw
        gh = sampling_ratio if sampling_ratio > 0 else math.ceil(rh / ph)
        gw = sampling_ratio if sampling_ratio > 0 else math.ceil(rw / pw)
        count = max(gh * gw, 1)
        for co in range(c_out):
            for i in range(ph):
                for j in range(pw):
                    ci = (co * ph + i) * pw + j
                    acc = input.new_zeros(())
                    for iy in range(gh):
                        for ix in range(gw):
                            y = y1 + i * bh + (iy + 0.5) * bh / gh
                            x = x1 + j * bw + (ix + 0.5) * bw / gw
                            acc = acc + _bilinear(input[b, ci], y, x)
                    out[k, co, i, j] = acc / count
                    mapping[k, co, i, j] = ci
    return out, mapping


def _deform_conv2d(input, weight, offset, mask, bias, sh, sw, padh, padw, dh, dw, groups, offset_groups, use_mask):
    n, c_in, h, w = input.shape
    c_out, _, kh, kw = weight.shape
    oh = (h + 2 * padh - (dh * (kh - 1) + 1)) // sh + 1
    ow = (w + 2 * padw - (dw * (kw - 1) + 1)) // sw + 1
    cols = input.new_zeros((n, c_in, kh, kw, oh, ow))
    cpg = c_in // offset_groups
    for b in range(n):
        for g in range(offset_groups):
            for ki in range(kh):
                for kj in range(kw):
                    t = ki * kw + kj
                    for y in range(oh):
                        for x in range(ow):
                            py = y * sh - padh + ki * dh + float(offset[b, g * 2 * kh * kw + 2 * t, y, x])
                            px = x * sw - padw + kj * dw + float(offset[b, g * 2 * kh * kw + 2 * t + 1, y, x])
                            v = _bilinear_zero(input[b, g * cpg:(g + 1) * cpg], py, px)
                            if use_mask:
                                v = v * mask[b, g * kh * kw + t, y, x]
                            cols[b, g * cpg:(g + 1) * cpg, ki, kj, y, x] = v
    cols = cols.reshape(n, groups, c_in // groups * kh * kw, oh * ow)
    wg = weight.reshape(groups, c_out // groups, -1)
    out = torch.einsum("gok,ngkp->ngop", wg, cols).reshape(n, c_out, oh, ow)
    return out + bias.reshape(1, -1, 1, 1)


def _bilinear_zero(plane, y, x):
    """deform_conv2d's sampling rule: each corner outside the image contributes zero."""
    height, width = plane.shape[-2:]
    if y <= -1 or y >= height or x <= -1 or x >= width:
        return plane.new_zeros(plane.shape[:-2])
    y0, x0 = math.floor(y), math.floor(x)
    ly, lx = y - y0, x - x0
    acc = plane.new_zeros(plane.shape[:-2])
    for yy, wy in ((y0, 1 - ly), (y0 + 1, ly)):
        for xx, wx in ((x0, 1 - lx), (x0 + 1, lx)):
            if 0 <= yy < height and 0 <= xx < width:
                acc = acc + wy * wx * plane[..., yy, xx]
    return acc


_KERNELS = {
    "nms": _nms,
    "roi_align": _roi_align,
    "_roi_align_backward": _roi_align_backward,
    "roi_pool": _roi_pool,
    "ps_roi_align": _ps_roi_align,
    "ps_roi_pool": _ps_roi_pool,
    "deform_conv2d": _deform_conv2d,
}
