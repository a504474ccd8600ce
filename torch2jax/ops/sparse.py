"""Sparse layouts: the jax device stores every tensor dense.

JAX arrays are dense, so a sparse COO tensor made on the jax device is built as
the dense tensor it stands for (duplicate indices summed, as ``coalesce`` would).
Its values are those of ``sparse.to_dense()``; what needs the sparse layout itself
(``_values()``, ``indices()``, ``torch.sparse`` kernels) is not available. The main
producer is ``nn.Embedding(sparse=True)``, whose weight gradient then arrives dense,
as if ``sparse=False``: every dense optimizer accepts it (SparseAdam refuses dense
gradients, as on any device).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import torch

from ..dispatch import OpError
from .creation import jax_dtype
from .linalg import addmm
from .reductions import sum_
from .registry import register

aten = torch.ops.aten

_warned = False


def _warn_dense():
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "torch2jax: the jax device has no sparse layout; a sparse COO tensor (e.g. the weight gradient of "
            "nn.Embedding(sparse=True)) is stored dense, with the same values as its to_dense()",
            stacklevel=2,
        )


@register(aten._sparse_coo_tensor_with_dims_and_tensors)
def _sparse_coo_tensor_with_dims_and_tensors(sparse_dim, dense_dim, size, indices, values, *, dtype=None,
                                             layout=None, device=None, pin_memory=None, is_coalesced=None):
    _warn_dense()
    dt = jax_dtype(dtype, values.dtype)
    return jnp.zeros(tuple(size), dt).at[tuple(indices[:sparse_dim])].add(values.astype(dt))


@register(aten._to_sparse, aten._to_sparse_csr, aten._to_sparse_csc, aten._to_sparse_bsr, aten._to_sparse_bsc)
def _to_sparse(x, *args, **kwargs):
    """A sparse layout cannot hold a jax array: say so, and what to do instead."""
    raise OpError(
        "torch2jax: to_sparse / to_sparse_csr / to_sparse_csc / to_sparse_bsr / to_sparse_bsc: the jax device has "
        "no sparse layouts (JAX arrays are dense); keep the tensor dense, or convert on the CPU: "
        "x.cpu().to_sparse()"
    )


# The sparse kernels that torch.sparse's functions call, on the dense stand-in: the same
# values as on the sparse tensor, as absent entries are zeros.

@register(aten._sparse_addmm.default)
def _sparse_addmm(self, mat1, mat2, *, beta=1, alpha=1):
    """``torch.sparse.mm`` / ``torch.sparse.addmm``: ``beta * self + alpha * (mat1 @ mat2)``."""
    return addmm(self, mat1, mat2, beta=beta, alpha=alpha)


@register(aten._sparse_sum.dim, aten._sparse_sum.dim_dtype)
def _sparse_sum_dim(self, dim, dtype=None):
    """``torch.sparse.sum(x, dim)``: summed over ``dim`` (dense, as the jax device stores every layout)."""
    return sum_(self, dim, dtype=dtype)

