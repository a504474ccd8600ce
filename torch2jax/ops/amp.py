"""Lowerings: the two ops behind `torch.amp.GradScaler` (float16 loss scaling).

``GradScaler.unscale_`` calls ``_amp_foreach_non_finite_check_and_unscale_`` and
``GradScaler.update`` calls ``_amp_update_scale_``. Both mutate two arguments (a
list of gradients and ``found_inf``; the scale and the growth tracker), which the
dispatcher's in-place route (one mutated ``self``) does not cover, so each has a
decomposition that runs the functional op's lowering and copies its results back.
The arithmetic follows torch's CPU / CUDA kernels: the check and the scaling are
computed in float32 for half-precision gradients, and the scale only grows when the
grown value is finite.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from .registry import decomposition, register

aten = torch.ops.aten


def _opmath(g):
    return g.astype(np.float32) if g.dtype in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)) else g


@register(aten._amp_foreach_non_finite_check_and_unscale.default)
def _amp_foreach_non_finite_check_and_unscale(grads, found_inf, inv_scale):
    """(grads * inv_scale, found_inf set to 1 if any gradient holds an inf or a NaN).

    >>> torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)  # in place
    """
    bad = jnp.zeros((), bool)
    out = []
    for g in grads:
        wide = _opmath(g)
        bad = bad | ~jnp.all(jnp.isfinite(wide))
        out.append((wide * inv_scale.reshape(()).astype(wide.dtype)).astype(g.dtype))
    return out, jnp.where(bad, jnp.ones_like(found_inf), found_inf)


@decomposition(aten._amp_foreach_non_finite_check_and_unscale_.default)
def _amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale):
    if not grads:
        return None
    unscaled, found = aten._amp_foreach_non_finite_check_and_unscale.default(grads, found_inf, inv_scale)
    for g, u in zip(grads, unscaled):
        g.copy_(u)
    found_inf.copy_(found)
    return None


@register(aten._amp_update_scale.default)
def _amp_update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """(new scale, new growth tracker): back off and restart counting after an
    overflow; grow after ``growth_interval`` clean steps in a row.

    >>> torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000)  # in place
    """
    if scale.dtype != np.float32:
        raise RuntimeError("_amp_update_scale_: scale must be a float32 tensor")
    overflow = found_inf.reshape(scale.shape) != 0
    successful = growth_tracker + 1
    grow = ~overflow & (successful == growth_interval)
    grown = scale * np.float32(growth_factor)
    new_scale = jnp.where(
        overflow, scale * np.float32(backoff_factor), jnp.where(grow & jnp.isfinite(grown), grown, scale)
    )
    new_tracker = jnp.where(overflow | grow, jnp.zeros_like(growth_tracker), successful)
    return new_scale.astype(scale.dtype), new_tracker.astype(growth_tracker.dtype)


@decomposition(aten._amp_update_scale_.default)
def _amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    new_scale, new_tracker = aten._amp_update_scale.default(
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
    )
    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)
    return scale
