"""Lowerings: torch's int8 weight-only matmul (``torch._weight_int8pack_mm``).

The op torchao and gpt-fast call for int8 weight-only linears: ``x @ w.T * scales``
with ``w`` int8 [N, K] and one scale per output row. The int8 weight is
converted inside the dot and the product accumulates in float32; the scale is
applied before the single rounding to ``x``'s dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .linalg import _precision
from .registry import register

aten = torch.ops.aten
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))


@register(aten._weight_int8pack_mm)
def _weight_int8pack_mm(x, w, scales):
    # Shapes and the dtypes of x and w are checked by torch's meta kernel when this raises (a
    # ValueError: the dispatcher then asks the meta kernel for torch's message); the scales'
    # dtype only by the CPU kernel, so it is checked here.
    if x.ndim != 2 or x.dtype not in _FLOATS or w.ndim != 2 or w.dtype != np.int8 or scales.ndim != 1:
        raise ValueError("_weight_int8pack_mm: expected x 2-D f32/f16/bf16, w 2-D int8, scales 1-D")
    if scales.dtype != x.dtype:
        raise RuntimeError(f"_weight_int8pack_mm: expected scales to have x's dtype {x.dtype}, got {scales.dtype}")
    acc = lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), precision=_precision(),
                          preferred_element_type=jnp.float32)
    return (acc * scales.astype(jnp.float32)).astype(x.dtype)
