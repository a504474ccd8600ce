"""Lowerings: matrix products, linear algebra and distances.

Products keep torch's dtypes: bf16/fp16 accumulate in float32 and round once,
integers multiply exactly in int64 and wrap to their own width. Products are
2-D dots wherever the shapes allow (XLA on CPU runs them much faster than a
batched dot or an einsum).

Factorizations follow LAPACK's conventions (JAX calls the same routines on
CPU), so the sign and phase choices of QR, SVD and eig match torch's; eigh's
eigenvector signs can still differ (torch's MKL and jaxlib's LAPACK reduce
small matrices differently), as they may between any two LAPACK builds.
LU pivots are torch's: 1-based int32. Where torch factors ``A^T`` of a real
matrix rather than ``A`` (det, slogdet: their backward formulas rely on it),
so do we, assuming a contiguous ``A``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.lax import linalg as lax_linalg

from .. import dtypes as _dt
from ..dispatch import OpError
from .registry import canonical_dim, register

aten = torch.ops.aten

_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


# ---------------------------------------------------------------------------
# products
# ---------------------------------------------------------------------------


def _precision():
    # torch.set_float32_matmul_precision("high"/"medium") allows TF32 / bf16 passes.
    if torch.get_float32_matmul_precision() == "highest":
        return lax.Precision.HIGHEST
    return lax.Precision.DEFAULT


def _acc_dtype(dtype):
    dtype = np.dtype(dtype)
    if dtype in _HALF:
        return np.dtype(np.float32)
    if _dt.is_integral(dtype, include_bool=True):
        return np.dtype(np.int64)
    return dtype


def _same_dtype(name, *arrays):
    dtypes = {np.dtype(a.dtype) for a in arrays}
    if len(dtypes) > 1:
        a, b = (_dt.to_torch(a.dtype) for a in arrays[:2])
        raise RuntimeError(f"{name}: expected m1 and m2 to have the same dtype, but got: {a} != {b}")


def _dot(a, b, contract, batch=((), ())):
    """``lax.dot_general`` in the accumulation dtype of ``a``."""
    return lax.dot_general(
        a, b, (contract, batch), precision=_precision(), preferred_element_type=_acc_dtype(a.dtype)
    )


def _mm(a, b):
    return _dot(a, b, ((a.ndim - 1,), (0,)))


def _bmm(a, b):
    if a.shape[0] == 1:  # einsum and tensordot often reach bmm with a batch of one
        return _mm(a[0], b[0])[None]
    return _dot(a, b, ((2,), (1,)), ((0,), (0,)))


def _finish(out, dtype):
    return out if out.dtype == dtype else out.astype(dtype)


def _scalar(value, dtype, half=True):
    """A Python scalar as torch's kernels see it: cast to the tensor's dtype (0.6 -> 0 for ints and,
    if ``half``, 0.6 -> 0.6015625 for bf16)."""
    if _dt.is_complex(dtype) or isinstance(value, bool):
        return value
    if _dt.is_integral(dtype):
        return int(value)
    if dtype in _HALF and not half:
        return value
    return float(np.asarray(value, dtype))


def _add_scaled(self, product, beta, alpha, round_half=False):
    """``beta * self + alpha * product`` in the accumulation dtype; ``self`` is ignored when beta is 0.

    ``round_half``: bf16/fp16 scalars are first rounded to the tensor's dtype (torch's gemv does).
    """
    beta, alpha = _scalar(beta, self.dtype, round_half), _scalar(alpha, self.dtype, round_half)
    out = product if alpha == 1 else product * alpha
    if beta == 0:
        return jnp.broadcast_to(out, jnp.broadcast_shapes(self.shape, out.shape))
    self = self.astype(out.dtype)
    return out + (self if beta == 1 else self * beta)


@register(aten.mm.default)
def mm(a, b):
    _same_dtype("mm", a, b)
    return _finish(_mm(a, b), a.dtype)


@register(aten.mm.dtype)
def mm_dtype(a, b, out_dtype):
    _same_dtype("mm", a, b)
    return _finish(_mm(a, b), _dt.to_jax(out_dtype))


@register(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``(i1 * i2 * i3).sum(sumdim)`` after each input gets size-1 dimensions at its
    ``expand`` positions (F.bilinear's x1^T W x2), as one contraction. Dimensions count in
    the expanded rank; the summed ones leave the result."""
    rank = i1.ndim + len(expand1)
    letters = [chr(ord("a") + d) for d in range(rank)]

    def subscript(expand):
        return "".join(letters[d] for d in range(rank) if d not in expand)

    summed = {d % rank for d in sumdim}
    out = "".join(letters[d] for d in range(rank) if d not in summed)
    spec = f"{subscript(expand1)},{subscript(expand2)},{subscript(expand3)}->{out}"
    result = jnp.einsum(spec, i1, i2, i3, precision=_precision(), preferred_element_type=_acc_dtype(i1.dtype))
    return _finish(result, i1.dtype)


@register(aten._int_mm)
def _int_mm(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=np.int32)


@register(aten.bmm.default)
def bmm(a, b):
    _same_dtype("bmm", a, b)
    return _finish(_bmm(a, b), a.dtype)


@register(aten.bmm.dtype)
def bmm_dtype(a, b, out_dtype):
    _same_dtype("bmm", a, b)
    return _finish(_bmm(a, b), _dt.to_jax(out_dtype))


@register(aten.addmm.default)
def addmm(self, a, b, *, beta=1, alpha=1):
    _same_dtype("addmm", a, b)
    return _finish(_add_scaled(self, _mm(a, b), beta, alpha), a.dtype)


@register(aten.addmm.dtype)
def addmm_dtype(self, a, b, out_dtype, *, beta=1, alpha=1):
    return _finish(_add_scaled(self, _mm(a, b), beta, alpha), _dt.to_jax(out_dtype))


@register(aten.baddbmm.default)
def baddbmm(self, a, b, *, beta=1, alpha=1):
    _same_dtype("baddbmm", a, b)
    return _finish(_add_scaled(self, _bmm(a, b), beta, alpha), a.dtype)


@register(aten.baddbmm.dtype)
def baddbmm_dtype(self, a, b, out_dtype, *, beta=1, alpha=1):
    return _finish(_add_scaled(self, _bmm(a, b), beta, alpha), _dt.to_jax(out_dtype))


@register(aten.addbmm.default)
def addbmm(self, a, b, *, beta=1, alpha=1):
    """``sum_i a[i] @ b[i]`` is one 2-D product: (n, B*k) @ (B*k, m).

    bf16 / fp16 follow torch's CPU kernel instead: one rounded addmm per batch.
    """
    _same_dtype("addbmm", a, b)
    nb, n, k = a.shape
    m = b.shape[2]
    if a.dtype in _HALF and nb > 0:
        start = _finish(_add_scaled(self, _mm(a[0], b[0]), beta, alpha), a.dtype)

        def step(acc, ab):
            return _finish(_add_scaled(acc, _mm(*ab), 1, alpha), a.dtype), None

        return lax.scan(step, start, (a[1:], b[1:]))[0]
    lhs = jnp.transpose(a, (1, 0, 2)).reshape(n, nb * k)
    return _finish(_add_scaled(self, _mm(lhs, b.reshape(nb * k, m)), beta, alpha), a.dtype)


@register(aten.mv.default)
def mv(a, v):
    _same_dtype("mv", a, v)
    return _finish(_mm(a, v), a.dtype)


@register(aten.addmv.default)
def addmv(self, a, v, *, beta=1, alpha=1):
    _same_dtype("addmv", a, v)
    return _finish(_add_scaled(self, _mm(a, v), beta, alpha, round_half=True), a.dtype)


def _check_dot(name, a, b):
    if a.ndim != 1 or b.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {a.ndim}D and {b.ndim}D tensors")
    if a.shape != b.shape:
        raise RuntimeError(
            f"inconsistent tensor size, expected tensor [{a.shape[0]}] and src [{b.shape[0]}] to have the same "
            "number of elements, but got {} and {} elements respectively".format(a.shape[0], b.shape[0])
        )
    if a.dtype != b.dtype:
        raise RuntimeError(
            f"{name} : expected both vectors to have same dtype, but found {_dt.to_torch(a.dtype)} and "
            f"{_dt.to_torch(b.dtype)}"
        )


@register(aten.dot.default)
def dot(a, b):
    _check_dot("dot", a, b)
    return _finish(_mm(a, b), a.dtype)


@register(aten.vdot.default)
def vdot(a, b):
    _check_dot("vdot", a, b)
    return _finish(_mm(jnp.conj(a), b), a.dtype)


@register(aten.addr.default)
def addr(self, v1, v2, *, beta=1, alpha=1):
    dtype = _dt.result_type(self, v1, v2)
    outer = v1[:, None].astype(dtype) * v2[None, :].astype(dtype)
    if dtype == np.bool_:
        out = outer & bool(alpha)
        return out if not beta else out | jnp.broadcast_to(self, out.shape).astype(np.bool_)
    if dtype in _HALF:  # torch's CPU kernel rounds after every operation
        beta, alpha = _scalar(beta, dtype), _scalar(alpha, dtype)
        product = (v1[:, None] * alpha).astype(dtype) * v2[None, :]
        out = product if beta == 0 else (self * beta).astype(dtype) + product
        return jnp.broadcast_to(out, outer.shape)
    return _add_scaled(self, outer, beta, alpha)


@register(aten.trace.default)
def trace(x):
    if x.ndim != 2:
        raise RuntimeError("trace: expected a matrix, but got tensor with dim " + str(x.ndim))
    dtype = np.dtype(np.int64) if _dt.is_integral(x.dtype, include_bool=True) else np.dtype(x.dtype)
    return _finish(jnp.trace(x, dtype=_acc_dtype(dtype)), dtype)


@register(aten.linalg_cross.default)
def linalg_cross(a, b, *, dim=-1):
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    d = canonical_dim(dim, len(shape))
    if shape[d] != 3:
        raise RuntimeError(
            f"linalg.cross: inputs dimension {dim} must have length 3. Got {a.shape[d]} and {b.shape[d]}"
        )
    dtype = _dt.result_type(a, b)
    a = jnp.broadcast_to(a, shape).astype(dtype)
    b = jnp.broadcast_to(b, shape).astype(dtype)

    def at(x, i):
        return lax.index_in_dim(x, i, d, keepdims=True)

    parts = [at(a, (i + 1) % 3) * at(b, (i + 2) % 3) - at(a, (i + 2) % 3) * at(b, (i + 1) % 3) for i in range(3)]
    return jnp.concatenate(parts, axis=d)


# ---------------------------------------------------------------------------
# distances
# ---------------------------------------------------------------------------


def _euclid_mm(x1, x2):
    """torch's matrix-product form of euclidean distances (fast, a little less exact)."""
    n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    a = jnp.concatenate([-2 * x1, n1, jnp.ones_like(n1)], axis=-1)
    b = jnp.concatenate([x2, jnp.ones_like(n2), n2], axis=-1)
    d2 = jnp.matmul(a, jnp.swapaxes(b, -1, -2), precision=_precision())
    return jnp.sqrt(jnp.maximum(d2, 0))


@register(aten._euclidean_dist.default)
def _euclidean_dist(x1, x2):
    return _euclid_mm(x1, x2)


def _pnorm_dist(diff, p):
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum(a != 0, axis=-1).astype(a.dtype)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    if math.isinf(p):
        return jnp.max(a, axis=-1, initial=0)
    return jnp.sum(a**p, axis=-1) ** (1.0 / p)


@register(aten._cdist_forward.default)
def _cdist_forward(x1, x2, p, compute_mode):
    if p < 0:
        raise RuntimeError(f"cdist only supports non-negative p values, got {p}")
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    r1, r2 = x1.shape[-2], x2.shape[-2]
    # compute_mode: None/0 = matrix product when either side has more than 25 rows, 1 = always, 2 = never.
    use_mm = p == 2 and (compute_mode == 1 or (compute_mode in (None, 0) and (r1 > 25 or r2 > 25)))
    if use_mm:
        return _euclid_mm(x1, x2)
    return _pnorm_dist(x1[..., :, None, :] - x2[..., None, :, :], p)


def _dist_grad(grad, x1, x2, p, dist):
    """d(sum grad * dist)/d x1 for dist[i, j] = ||x1[i] - x2[j]||_p (torch's conventions at 0)."""
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    g = grad[..., None]
    d = dist[..., None]
    if p == 0:
        return jnp.zeros_like(x1)
    if p == 1:
        terms = g * jnp.sign(diff)
    elif math.isinf(p):
        terms = g * jnp.sign(diff) * (jnp.abs(diff) == d)
    else:
        safe = jnp.where(d == 0, 1, d)
        if p == 2:
            terms = g * diff / safe
        elif p < 2:
            terms = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) * g / safe ** (p - 1)
            if p < 1:
                terms = jnp.where(diff == 0, 0, terms)
        else:
            terms = diff * jnp.abs(diff) ** (p - 2) * g / safe ** (p - 1)
        terms = jnp.where(d == 0, 0, terms)
    return jnp.sum(terms, axis=-2).astype(x1.dtype)


@register(aten._cdist_backward.default)
def _cdist_backward(grad, x1, x2, p, dist):
    batch = dist.shape[:-2]
    x1b = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2b = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    out = _dist_grad(grad, x1b, x2b, p, dist)
    extra = out.ndim - x1.ndim
    if extra or out.shape != x1.shape:
        axes = tuple(i for i in range(out.ndim - 2) if i < extra or x1.shape[i - extra] == 1)
        out = jnp.sum(out, axis=axes, keepdims=True).reshape(x1.shape)
    return out


def _pdist_pairs(n):
    return np.triu_indices(n, 1)


@register(aten._pdist_forward.default)
def _pdist_forward(x, p=2.0):
    if x.ndim != 2:
        raise RuntimeError(f"pdist only supports 2D tensors, got: {x.ndim}D")
    if p < 0:
        raise RuntimeError("pdist only supports non-negative p values")
    i, j = _pdist_pairs(x.shape[0])
    return _pnorm_dist(x[i] - x[j], p)


@register(aten._pdist_backward.default)
def _pdist_backward(grad, x, p, dist):
    n = x.shape[0]
    i, j = _pdist_pairs(n)
    g = jnp.zeros((n, n), grad.dtype).at[i, j].set(grad).at[j, i].set(grad)
    d = jnp.zeros((n, n), dist.dtype).at[i, j].set(dist).at[j, i].set(dist)
    return _dist_grad(g, x, x, p, d)


# ---------------------------------------------------------------------------
# helpers for factorizations
# ---------------------------------------------------------------------------


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if _dt.is_complex(x.dtype) else _mT(x)


def _broadcast_batch(a, b):
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _tri_solve(a, b, *, lower, left=True, adjoint=False, unit=False):
    """Solve op(a) x = b (left) or x op(a) = b, op = adjoint or identity, ``a`` triangular."""
    a, b = _broadcast_batch(a, b)
    return lax_linalg.triangular_solve(
        a, b, left_side=left, lower=lower, transpose_a=adjoint, conjugate_a=adjoint, unit_diagonal=unit
    )


def _diagonal(x):
    return jnp.diagonal(x, axis1=-2, axis2=-1)


def _first_true(mask):
    """1-based index of the first True along the last axis, 0 if none (LAPACK's ``info``)."""
    if mask.shape[-1] == 0:
        return jnp.zeros(mask.shape[:-1], np.int32)
    return jnp.where(jnp.any(mask, axis=-1), jnp.argmax(mask, axis=-1) + 1, 0).astype(np.int32)


def _lu(a):
    """(LU, torch pivots, permutation, info) of ``a``."""
    lu, pivots, perm = lax_linalg.lu(a)
    return lu, pivots + 1, perm, _first_true(_diagonal(lu) == 0)


def _lu_of_input(a):
    """torch factors the transpose of a real matrix (see the module docstring)."""
    return _lu(a if _dt.is_complex(a.dtype) else _mT(a))


def _permute_rows(b, perm):
    return jnp.take_along_axis(b, perm[..., :, None], axis=-2)


def _unpermute_rows(b, perm):
    inverse = jnp.argsort(perm, axis=-1)
    return _permute_rows(b, inverse)


def _lu_solve(lu, perm, b, *, left=True, adjoint=False):
    """Solve with ``A = P L U`` where ``A[perm] = L U``."""
    if not left:  # X A = B  <=>  A^H X^H = B^H
        return _mH(_lu_solve(lu, perm, _mH(b), adjoint=not adjoint))
    lu, b = _broadcast_batch(lu, b)
    perm = jnp.broadcast_to(perm, lu.shape[:-1])
    if not adjoint:
        y = _tri_solve(lu, _permute_rows(b, perm), lower=True, unit=True)
        return _tri_solve(lu, y, lower=False)
    y = _tri_solve(lu, b, lower=False, adjoint=True)
    y = _tri_solve(lu, y, lower=True, adjoint=True, unit=True)
    return _unpermute_rows(y, perm)


def _is_vector_rhs(a, b):
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


def _pivots_to_perm(pivots, n):
    return lax_linalg.lu_pivots_to_permutation(pivots - 1, n)


def _empty(dtype):
    return jnp.zeros((0,), dtype)


@register(aten._linalg_check_errors.default)
def _linalg_check_errors(info, api_name, *, is_matrix):
    """A no-op: errors would need a device sync (and cannot be raised under jit);
    ill-conditioned inputs give inf / nan as in the ``_ex`` variants."""
    return None


# ---------------------------------------------------------------------------
# solve, inverse, determinant
# ---------------------------------------------------------------------------


@register(aten._linalg_solve_ex.default)
def _linalg_solve_ex(a, b, *, left=True, check_errors=False):
    lu, pivots, perm, info = _lu(a)
    vector = _is_vector_rhs(a, b)
    rhs = b[..., None] if vector else b
    if not left and vector:
        rhs = b[..., None, :]
    x = _lu_solve(lu, perm, rhs, left=left)
    if vector:
        x = x[..., 0] if left else x[..., 0, :]
    return x, lu, pivots, info


@register(aten.linalg_inv_ex.default)
def linalg_inv_ex(a, *, check_errors=False):
    lu, _, perm, info = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, perm, eye), info


@register(aten._linalg_det.default)
def _linalg_det(a):
    lu, pivots, _, _ = _lu_of_input(a)
    return _det_from_lu(lu, pivots), lu, pivots


def _parity(pivots):
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype), axis=-1)
    return 1 - 2 * (swaps % 2)


def _det_from_lu(lu, pivots):
    return jnp.prod(_diagonal(lu), axis=-1) * _parity(pivots).astype(lu.dtype)


@register(aten._linalg_slogdet.default)
def _linalg_slogdet(a):
    lu, pivots, _, _ = _lu_of_input(a)
    diag = _diagonal(lu)
    absdiag = jnp.abs(diag)
    logabsdet = jnp.sum(jnp.log(absdiag), axis=-1)
    unit = jnp.where(absdiag == 0, 0, diag / jnp.where(absdiag == 0, 1, absdiag).astype(diag.dtype))
    sign = jnp.prod(unit, axis=-1) * _parity(pivots).astype(diag.dtype)
    return sign, logabsdet, lu, pivots


# ---------------------------------------------------------------------------
# LU
# ---------------------------------------------------------------------------


@register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")
    lu, pivots, _, info = _lu(a)
    return lu, pivots, info


def _unpack_lu(lu, perm, m, n):
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    # A = P L U with A[perm] = L U: P[perm[i], i] = 1
    p = jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=lu.dtype), -1, -2)
    return p, lower, upper


@register(aten.linalg_lu.default)
def linalg_lu(a, *, pivot=True):
    if not pivot:
        raise RuntimeError("linalg.lu: LU without pivoting is not implemented on the CPU")
    lu, _, perm, _ = _lu(a)
    return _unpack_lu(lu, perm, *a.shape[-2:])


@register(aten.lu_unpack.default)
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2:]
    perm = _pivots_to_perm(pivots, m)
    p, lower, upper = _unpack_lu(lu, perm, m, n)
    if not unpack_data:
        lower = upper = _empty(lu.dtype)
    if not unpack_pivots:
        p = _empty(lu.dtype)
    return p, lower, upper


@register(aten.linalg_lu_solve.default)
def linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    return _lu_solve(lu, _pivots_to_perm(pivots, lu.shape[-1]), b, left=left, adjoint=adjoint)


# ---------------------------------------------------------------------------
# triangular and Cholesky
# ---------------------------------------------------------------------------


@register(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    return _tri_solve(a, b, lower=not upper, left=left, unit=unitriangular)


@register(aten.triangular_solve.default)
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    a, b = _broadcast_batch(a, b)
    x = lax_linalg.triangular_solve(
        a, b, left_side=True, lower=not upper, transpose_a=transpose, unit_diagonal=unitriangular
    )
    return x, a


def _cholesky(a, upper):
    lower = lax_linalg.cholesky(a, symmetrize_input=False)
    return _mH(lower) if upper else lower


@register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    out = _cholesky(a, upper)
    info = _first_true(jnp.isnan(jnp.real(_diagonal(out))))
    return out, info


@register(aten.cholesky.default)
def cholesky(a, upper=False):
    return _cholesky(a, upper)


def _cholesky_solve(b, factor, upper):
    if upper:  # A = U^H U
        y = _tri_solve(factor, b, lower=False, adjoint=True)
        return _tri_solve(factor, y, lower=False)
    y = _tri_solve(factor, b, lower=True)
    return _tri_solve(factor, y, lower=True, adjoint=True)


@register(aten.cholesky_solve.default)
def cholesky_solve(b, factor, upper=False):
    return _cholesky_solve(b, factor, upper)


@register(aten.cholesky_inverse.default)
def cholesky_inverse(factor, upper=False):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return _cholesky_solve(eye, factor, upper)


# ---------------------------------------------------------------------------
# LDL (Bunch-Kaufman)
# ---------------------------------------------------------------------------
#
# torch factors with LAPACK's sytrf / hetrf on the lower triangle (uplo "L"):
# A = L D L^T (L D L^H when hermitian) where D has 1x1 and 2x2 diagonal blocks and
# L = P(1) L(1) P(2) L(2) ..., each P(k) an interchange of two rows and columns and
# each L(k) unit lower triangular with the multipliers of block k in its columns. LD
# holds D on the diagonal (a 2x2 block's off-diagonal entry just below it) and the
# multipliers below; the interchanges are not applied to earlier columns. pivots is
# 1-based: k when column k was swapped with row k, -p on both columns of a 2x2 block
# whose second column was swapped with row p. Below is the column-by-column sytf2 /
# hetf2, which LAPACK runs for n up to its block size (64 in the reference
# implementation); past that its blocked sytrf makes the same pivot choices with the
# updates grouped, so the entries differ by rounding only. Against torch's MKL the
# pivots are identical (random symmetric, complex symmetric and Hermitian matrices up
# to n = 200 were compared) and LD agrees to a few units in the last place: XLA fuses
# the updates' multiply-adds into FMAs, which LAPACK's reference order of operations
# (reproduced bit for bit by MKL for small n) does not. With NaN in the input, the pivot
# search follows MKL's handling of NaN as measured; a few complex matrices with several
# NaNs still get other pivots than MKL's.

# The Bunch-Kaufman threshold: it bounds the growth of the entries while pivoting
_BK_ALPHA = (1 + math.sqrt(17)) / 8


def _bk_size(x):
    """The size LAPACK compares when choosing a pivot: |x| for reals, |re| + |im| for complex."""
    if _dt.is_complex(x.dtype):
        return jnp.abs(jnp.real(x)) + jnp.abs(jnp.imag(x))
    return jnp.abs(x)


def _ldl_factor_matrix(a, hermitian):
    """(LD, pivots, info) of one n x n matrix, from its lower triangle (see above).

    The trailing block still to factor is kept as a full symmetric (Hermitian) matrix, so
    a symmetric interchange is a gather; the updates are computed on its lower triangle
    with LAPACK's formulas, in its order of operations, and mirrored onto the upper. A
    column with no nonzero entry (of a complex matrix: or with a NaN diagonal) is left as
    it is, with info pointing at the first such column, as MKL does.
    """
    n = a.shape[-1]
    herm = hermitian and _dt.is_complex(a.dtype)
    real = _dt.real_of(a.dtype)
    idx = jnp.arange(n)
    below_or_on = idx[:, None] >= idx[None, :]

    def mirror(x):
        """``x``'s lower triangle reflected onto its upper (a Hermitian diagonal made real)."""
        upper = jnp.conj(x.T) if herm else x.T
        x = jnp.where(below_or_on, x, upper)
        return jnp.where(idx[:, None] == idx[None, :], jnp.real(x).astype(x.dtype), x) if herm else x

    def diag_size(v):
        return jnp.abs(jnp.real(v)) if herm else _bk_size(v)

    alpha = jnp.asarray(_BK_ALPHA, real)

    def step(k, m, piv, info):
        # the pivot choice of sytf2: a 1x1 pivot at k, a 1x1 pivot at imax, or a 2x2 block (k, imax).
        # The largest entries are found as MKL finds them where NaN is involved (measured): the
        # first NaN wins a column's search, and MAX(a, b) is b unless a > b
        size_kk = diag_size(m[k, k])
        col = jnp.where(idx > k, _bk_size(m[:, k]), -1)
        imax = jnp.argmax(col)
        colmax = jnp.where(k < n - 1, col[imax], 0)
        row = _bk_size(m[imax])
        rowmax = jnp.max(jnp.where((idx >= k) & (idx < imax), row, -1))
        below = jnp.max(jnp.where(idx > imax, row, -1))
        rowmax = jnp.where((imax < n - 1) & ~(rowmax > below), below, rowmax)
        singular = jnp.where(size_kk > colmax, size_kk, colmax) == 0
        if _dt.is_complex(a.dtype):
            # MKL's complex routines stop at a NaN diagonal (as reference LAPACK does); its real ones pivot on
            singular = singular | jnp.isnan(size_kk)
        stay = (size_kk >= alpha * colmax) | (size_kk >= alpha * colmax * (colmax / rowmax))
        single = stay | (diag_size(m[imax, imax]) >= alpha * rowmax)
        kp = jnp.where(singular | stay, k, imax)
        two = ~singular & ~single
        kk = k + two
        # swap rows and columns kk and kp of the trailing block; earlier columns keep their rows
        swap = idx.at[kk].set(kp).at[kp].set(kk)
        trailing = (idx[:, None] >= k) & (idx[None, :] >= k)
        m = jnp.where(trailing, m[swap][:, swap], m)

        # 1x1: A -= x (1/d) x^T with x the column below d, then the column becomes x * (1/d) (syr, scal)
        x = m[:, k]
        if herm:
            r = 1 / jnp.real(m[k, k])
            one_update = m + x[:, None] * (-r * jnp.conj(x))[None, :]
        else:
            r = 1 / m[k, k]
            one_update = m + x[:, None] * (-r * x)[None, :]
        one_col = r * x
        # 2x2: the two columns' multipliers w, then A -= x_k w_k^T + x_k1 w_k1^T (sytf2's scaled form)
        x1 = m[:, k + 1]
        if herm:
            e = jnp.abs(m[k + 1, k])
            d11, d22 = jnp.real(m[k + 1, k + 1]) / e, jnp.real(m[k, k]) / e
            t = 1 / (d11 * d22 - 1)
            d21 = m[k + 1, k] / e
            s = t / e
            w0 = s * (d11 * x - d21 * x1)
            w1 = s * (d22 * x1 - jnp.conj(d21) * x)
            two_update = m - x[:, None] * jnp.conj(w0)[None, :] - x1[:, None] * jnp.conj(w1)[None, :]
        else:
            d21 = m[k + 1, k]
            d11, d22 = m[k + 1, k + 1] / d21, m[k, k] / d21
            t = 1 / (d11 * d22 - 1)
            s = t / d21
            w0 = s * (d11 * x - x1)
            w1 = s * (d22 * x1 - x)
            two_update = m - x[:, None] * w0[None, :] - x1[:, None] * w1[None, :]

        rest = idx > kk
        block = rest[:, None] & rest[None, :]
        updated = jnp.where(block, mirror(jnp.where(two, two_update, one_update)), m)
        updated = updated.at[:, k].set(jnp.where(rest, jnp.where(two, w0, one_col), m[:, k]))
        # a 2x2 block's second column (past the last column there is none: the write is dropped)
        second = updated[:, jnp.minimum(k + 1, n - 1)]
        updated = updated.at[:, k + 1].set(jnp.where(rest & two, w1, second), mode="drop")
        m = jnp.where(singular, m, updated)

        pivot = (kp + 1).astype(np.int32)
        piv = piv.at[k].set(jnp.where(two, -pivot, pivot))
        piv = piv.at[k + 1].set(jnp.where(two, -pivot, piv[jnp.minimum(k + 1, n - 1)]), mode="drop")
        info = jnp.where((info == 0) & singular, k + 1, info).astype(np.int32)
        return m, piv, info, two

    def body(k, state):
        m, piv, info, second = state
        new_m, new_piv, new_info, two = step(k, m, piv, info)
        # the second column of a 2x2 block was factored with the first: nothing to do
        return (jnp.where(second, m, new_m), jnp.where(second, piv, new_piv), jnp.where(second, info, new_info),
                ~second & two)

    state = (mirror(jnp.tril(a)), jnp.zeros(n, np.int32), jnp.zeros((), np.int32), jnp.zeros((), bool))
    m, piv, info, _ = lax.fori_loop(0, n, body, state)
    return jnp.tril(m), piv, info


@register(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(a, *, hermitian=False, check_errors=False):
    """Bunch-Kaufman LDL^T (LDL^H) of the lower triangles of ``a`` with LAPACK's pivots (see above)."""
    if a.ndim < 2:
        raise RuntimeError("torch.linalg.ldl_factor_ex: The input tensor A must have at least 2 dimensions.")
    if a.shape[-1] != a.shape[-2]:
        raise RuntimeError(f"torch.linalg.ldl_factor_ex: A must be batches of square matrices, but they are "
                           f"{a.shape[-2]} by {a.shape[-1]} matrices")
    if not (_dt.is_floating(a.dtype) or _dt.is_complex(a.dtype)):
        raise RuntimeError("torch.linalg.ldl_factor_ex: Expected a floating point or complex tensor as input. "
                           f"Got {str(_dt.to_torch(a.dtype)).replace('torch.', '').capitalize()}")
    n, batch = a.shape[-1], a.shape[:-2]
    if n == 0 or math.prod(batch) == 0:
        return jnp.zeros(a.shape, a.dtype), jnp.zeros(batch + (n,), np.int32), jnp.zeros(batch, np.int32)
    factor = jax.vmap(functools.partial(_ldl_factor_matrix, hermitian=hermitian))
    ld, piv, info = factor(a.reshape((-1, n, n)))
    return ld.reshape(a.shape), piv.reshape(batch + (n,)), info.reshape(batch)


def _ldl_solve_matrix(ld, pivots, b, hermitian):
    """X with A X = B for one LAPACK LDL factorization (LD, pivots) of A (see above).

    The factorization is rewritten as A = P L D L^T P^T (L^H when hermitian): every
    interchange moved to the front, which swaps the rows of the multipliers of the blocks
    before it (as an LU factorization's row swaps do), so L is unit lower triangular and the
    solve is two triangular solves around D's 1x1 and 2x2 blocks (solved in sytrs's scaled
    form, which does not overflow where D's entries are large).
    """
    n = ld.shape[-1]
    herm = hermitian and _dt.is_complex(ld.dtype)
    idx = jnp.arange(n)

    # a negative pivot starts a 2x2 block unless it is the second column of one
    def mark(second, p):
        first = (p < 0) & ~second
        return first, (first, second)

    _, (first, second) = lax.scan(mark, jnp.zeros((), bool), pivots)
    # the interchange made at each column: a 1x1 pivot's row, or a 2x2 block's second
    # column with its row; it moves the rows of the columns before the block
    target = jnp.where(pivots > 0, pivots - 1, jnp.where(second, -pivots - 1, idx)).astype(np.int32)
    start = jnp.where(second, idx - 1, idx)

    def interchange(t, lower):
        p = target[t]
        swapped = lower.at[t].set(lower[p]).at[p].set(lower[t])
        return jnp.where(idx[None, :] < start[t], swapped, lower)

    # D's 2x2 off-diagonal entries sit below its diagonal; they are not multipliers
    lower = jnp.where((idx[:, None] == idx[None, :] + 1) & second[:, None], 0, jnp.tril(ld, -1))
    lower = lax.fori_loop(0, n, interchange, lower) + jnp.eye(n, dtype=ld.dtype)
    perm = lax_linalg.lu_pivots_to_permutation(target, n)

    y = lax_linalg.triangular_solve(lower, b[perm], left_side=True, lower=True, unit_diagonal=True)
    diag = _diagonal(ld)
    # the 2x2 block [[d0, c~], [c, d1]] a row of y belongs to (indices clamped: rows of 1x1
    # blocks compute a value that is not used)
    s0, s1 = start, jnp.minimum(start + 1, n - 1)
    c, d0, d1, y0, y1 = ld[s1, s0], ld[s0, s0], ld[s1, s1], y[s0], y[s1]
    c_up = jnp.conj(c) if herm else c
    a0, a1 = d0 / c_up, d1 / c
    denom = a0 * a1 - 1
    b0, b1 = y0 / c_up[:, None], y1 / c[:, None]
    pair_first = (a1[:, None] * b0 - b1) / denom[:, None]
    pair_second = (a0[:, None] * b1 - b0) / denom[:, None]
    inv = 1 / (jnp.real(diag).astype(ld.dtype) if herm else diag)
    w = jnp.where(first[:, None], pair_first, jnp.where(second[:, None], pair_second, y * inv[:, None]))
    z = lax_linalg.triangular_solve(lower, w, left_side=True, lower=True, transpose_a=True, conjugate_a=herm,
                                    unit_diagonal=True)
    return z[jnp.argsort(perm)]


@register(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(ld, pivots, b, *, hermitian=False):
    """Solve A X = B from torch's LDL factorization of A (``linalg_ldl_factor_ex``); batch
    dimensions broadcast."""
    if ld.ndim < 2 or b.ndim < 2:
        raise RuntimeError("torch.linalg.ldl_solve: LD and B must have at least 2 dimensions")
    if ld.shape[-1] != ld.shape[-2]:
        raise RuntimeError(f"torch.linalg.ldl_solve: A must be batches of square matrices, but they are "
                           f"{ld.shape[-2]} by {ld.shape[-1]} matrices")
    if pivots.shape != ld.shape[:-1]:
        raise RuntimeError("torch.linalg.ldl_solve: Expected LD.shape[:-1] and pivots.shape to be the same, "
                           f"but got pivots with shape {list(pivots.shape)} instead")
    if b.dtype != ld.dtype:
        raise RuntimeError(f"Expected b and A to have the same dtype, but found b of type {_dt.to_torch(b.dtype)} "
                           f"and A of type {_dt.to_torch(ld.dtype)} instead.")
    n = ld.shape[-1]
    if b.shape[-2] != n:
        raise RuntimeError(f"Incompatible matrix sizes for torch.linalg.ldl_solve: each A matrix is {n} by {n} "
                           f"but each b matrix is {b.shape[-2]} by {b.shape[-1]}")
    batch = jnp.broadcast_shapes(ld.shape[:-2], b.shape[:-2])
    out_shape = batch + b.shape[-2:]
    if n == 0 or math.prod(out_shape) == 0:
        return jnp.zeros(out_shape, ld.dtype)
    ld = jnp.broadcast_to(ld, batch + (n, n)).reshape(-1, n, n)
    pivots = jnp.broadcast_to(pivots, batch + (n,)).reshape(-1, n).astype(np.int32)
    b = jnp.broadcast_to(b, out_shape).reshape((-1,) + b.shape[-2:])
    solve = jax.vmap(functools.partial(_ldl_solve_matrix, hermitian=hermitian))
    return solve(ld, pivots, b).reshape(out_shape)


# ---------------------------------------------------------------------------
# eigen, singular values, QR
# ---------------------------------------------------------------------------


@register(aten._linalg_eigh.default)
def _linalg_eigh(a, UPLO="L", compute_v=True):
    vectors, values = lax_linalg.eigh(a, lower=UPLO.upper() == "L", symmetrize_input=False)
    return values, vectors if compute_v else _empty(a.dtype)


@register(aten.linalg_eig.default)
def linalg_eig(a):
    values, vectors = lax_linalg.eig(a, compute_left_eigenvectors=False)
    return values, vectors


@register(aten._linalg_eigvals.default)
def _linalg_eigvals(a):
    (values,) = lax_linalg.eig(a, compute_left_eigenvectors=False, compute_right_eigenvectors=False)
    return values


@register(aten._linalg_svd.default)
def _linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        s = lax_linalg.svd(a, full_matrices=False, compute_uv=False)
        return _empty(a.dtype), s, _empty(a.dtype)
    return tuple(lax_linalg.svd(a, full_matrices=full_matrices))


@register(aten.linalg_qr.default)
def linalg_qr(a, mode="reduced"):
    if mode not in ("reduced", "complete", "r"):
        raise RuntimeError(
            f"qr received unrecognized mode '{mode}' but expected one of 'reduced' (default), 'r', or 'complete'"
        )
    q, r = lax_linalg.qr(a, full_matrices=mode == "complete")
    return (_empty(a.dtype) if mode == "r" else q), r


@register(aten.geqrf.default)
def geqrf(a):
    h, tau = jnp.linalg.qr(a, mode="raw")
    return _mT(h), tau


@register(aten.linalg_householder_product.default)
def linalg_householder_product(a, tau):
    return lax_linalg.householder_product(a, tau)


@register(aten.ormqr.default)
def ormqr(a, tau, c, left=True, transpose=False):
    m = a.shape[-2]
    k = tau.shape[-1]
    # The full m x m Q: the reflectors padded with zero ones (tau = 0 is the identity).
    square = jnp.pad(a[..., :k], [(0, 0)] * (a.ndim - 1) + [(0, m - k)])
    q = lax_linalg.householder_product(square, jnp.pad(tau, [(0, 0)] * (tau.ndim - 1) + [(0, m - k)]))
    if transpose:
        q = _mH(q)
    return jnp.matmul(q, c, precision=_precision()) if left else jnp.matmul(c, q, precision=_precision())


# Taylor-type approximants of degree 1, 2, 4, 8, 12, 18 and the 1-norm bounds up to which each
# is accurate, as in torch (Bader, Blanes & Casas, "Computing the matrix exponential with an
# optimized Taylor polynomial approximation", Mathematics 7 (2019) 1174).
_EXP_THETAS = {
    np.dtype(np.float32): (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02,
                           5.800524627688768e-01, 1.461661507209034e00, 3.010066362817634e00),
    np.dtype(np.float64): (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04,
                           4.991228871115323e-02, 2.996158913811580e-01, 1.090863719290036e00),
}
_EXP_B12 = np.array([
    [9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740],
    [5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031, 0.01108844528519167989],
    [0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968, 0.00610700528898058230],
    [-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359],
])
_EXP_B18 = np.array([
    [0.0, -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.0],
    [0.0, 3.97849749499645077844e-01, 1.36783778460411720168e00, 4.98289622525382669416e-01,
     -6.37898194594723280150e-04],
    [-1.09676396052962061844e01, 1.68015813878906206114e00, 5.71779846478865511061e-02,
     -6.98210122488052056106e-03, 3.34975017086070470649e-05],
    [-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
     2.95552570429315521194e-02, -1.39180257516060693404e-05],
    [0.0, 0.0, -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05],
])


def _combine(coeffs, mats, dtype):
    """Rows of ``coeffs`` (numbers) times the stacked matrices ``mats``."""
    c = np.asarray(coeffs, _dt.real_of(dtype)).astype(dtype)
    return [sum(ci * m for ci, m in zip(row, mats) if ci != 0) for row in c]


def _exp_taylor(a, degree):
    mm = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    if degree == 1:
        return eye + a
    a2 = mm(a, a)
    if degree == 2:
        return eye + a + a2 / 2
    if degree == 4:
        return eye + a + mm(a2, eye / 2 + a / 6 + a2 / 24)
    if degree == 8:
        r = 0.1330413469565007072504e2  # sqrt(177)
        x3 = 2.0 / 3.0
        x1, x2 = x3 * ((1.0 + r) / 88.0), x3 * ((1.0 + r) / 352.0)
        x4, x5 = (-271.0 + 29.0 * r) / (315.0 * x3), (-11.0 + 11.0 * r) / (1260.0 * x3)
        x6, x7 = (-99.0 + 11.0 * r) / (5040.0 * x3), (89.0 - r) / (5040.0 * x3)
        y2 = (857.0 - 58.0 * r) / 630.0
        (x1, x2, x3, x4, x5, x6, x7, y2) = (float(np.asarray(v, _dt.real_of(a.dtype)))
                                              for v in (x1, x2, x3, x4, x5, x6, x7, y2))
        a4 = mm(a2, x1 * a + x2 * a2)
        a8 = mm(x3 * a2 + a4, x4 * eye + x5 * a + x6 * a2 + x7 * a4)
        return eye + a + y2 * a2 + a8
    a3 = mm(a, a2)
    if degree == 12:
        b = _combine(_EXP_B12, [eye, a, a2, a3], a.dtype)
        b2 = b[2] + mm(b[3], b[3])
        return b[0] + mm(b[1] + b2, b2)
    b = _combine(_EXP_B18, [eye, a, a2, a3, mm(a3, a3)], a.dtype)
    b3 = b[3] + mm(b[0], b[4])
    return b[1] + mm(b[2] + b3, b3)


def _exp_scaled(a, norm, theta):
    """Degree 18 on ``a / 2^s`` with ``norm / 2^s <= theta``, then squared ``s`` times."""
    s = jnp.maximum(0, jnp.ceil(jnp.log2(norm / theta))).astype(np.int32)
    scale = jnp.exp2(s.astype(_dt.real_of(a.dtype))).astype(a.dtype)
    out = _exp_taylor(a / scale[..., None, None], 18)

    def cond(state):
        return jnp.any(state[0] < s)

    def square(state):
        i, m = state
        return i + 1, jnp.where((i < s)[..., None, None], jnp.matmul(m, m, precision=lax.Precision.HIGHEST), m)

    return lax.while_loop(cond, square, (jnp.zeros((), np.int32), out))[1]


@register(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(a):
    """torch's algorithm: the cheapest Taylor approximant accurate for each matrix's 1-norm."""
    if a.shape[-1] == 0:
        return a
    if a.shape[-1] == 1:
        return jnp.exp(a)
    dtype = a.dtype
    if dtype in _HALF:
        a = a.astype(np.float32)
    thetas = _EXP_THETAS[np.dtype(_dt.real_of(a.dtype))]
    norm = jnp.max(jnp.sum(jnp.abs(a), axis=-2), axis=-1)
    out = _exp_scaled(a, norm, thetas[5])
    low = -1.0
    for degree, high in zip((1, 2, 4, 8, 12), thetas[:5]):
        pick = (low < norm) & (norm <= high) & (norm < thetas[4])
        out = jnp.where(pick[..., None, None], _exp_taylor(a, degree), out)
        low = high
    return out.astype(dtype)


@register(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    m, n = a.shape[-2:]
    real = _dt.real_of(a.dtype)
    default_rtol = jnp.asarray(np.finfo(real).eps * max(m, n), real)
    if rtol is None:
        rtol = default_rtol if atol is None else jnp.where(atol > 0, 0, default_rtol)
    atol = jnp.zeros((), real) if atol is None else jnp.asarray(atol, real)
    rtol = jnp.asarray(rtol, real)
    if a.size == 0:
        return jnp.zeros(a.shape[:-2] + (n, m), a.dtype)
    if hermitian:
        vectors, values = lax_linalg.eigh(a, symmetrize_input=False)
        s = jnp.abs(values)
        tol = jnp.maximum(atol[..., None], rtol[..., None] * jnp.max(s, axis=-1, keepdims=True))
        inv = jnp.where(s > tol, 1 / values, 0).astype(a.dtype)
        return jnp.matmul(vectors * inv[..., None, :], _mH(vectors), precision=_precision())
    u, s, vh = lax_linalg.svd(a, full_matrices=False)
    tol = jnp.maximum(atol[..., None], rtol[..., None] * s[..., :1])
    inv = jnp.where(s > tol, 1 / s, 0).astype(a.dtype)
    return jnp.matmul(_mH(vh) * inv[..., None, :], _mH(u), precision=_precision())


@register(aten.linalg_lstsq.default)
def linalg_lstsq(a, b, rcond=None, *, driver=None):
    """The minimum-norm solution from an SVD, for every driver (they agree on full-rank
    input); rank / singular values / residuals are returned where torch's driver returns them."""
    driver = driver or "gelsy"
    if driver not in ("gels", "gelsy", "gelsd", "gelss"):
        raise RuntimeError(f"torch.linalg.lstsq: parameter `driver` should be one of (gels, gelsy, gelsd, gelss)")
    m, n = a.shape[-2:]
    real = _dt.real_of(a.dtype)
    vector = b.ndim == a.ndim - 1
    rhs = b[..., None] if vector else b
    if rcond is None or rcond < 0:
        rcond = np.finfo(real).eps * max(m, n)
    a_b, rhs = _broadcast_batch(a, rhs)
    u, s, vh = lax_linalg.svd(a_b, full_matrices=False)
    keep = s > rcond * s[..., :1] if s.shape[-1] else s > 0
    inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(a.dtype)
    uhb = jnp.matmul(_mH(u), rhs, precision=_precision())
    x = jnp.matmul(_mH(vh), inv[..., :, None] * uhb, precision=_precision())
    rank = jnp.sum(keep, axis=-1).astype(np.int64)
    residuals = _empty(real)
    if m > n and driver != "gelsy":
        full = rank == n
        if driver in ("gelsd", "gelss") and isinstance(full, jax.core.Tracer):
            raise OpError(
                f"torch2jax: linalg_lstsq with driver={driver!r} returns residuals only for full-rank input, "
                "a data-dependent shape that cannot be traced; use driver='gels' or 'gelsy' under jit"
            )
        if driver == "gels" or bool(jnp.all(full)):
            r = jnp.abs(jnp.matmul(a_b, x, precision=_precision()) - rhs) ** 2
            residuals = jnp.sum(r, axis=-2)
            residuals = residuals[..., 0] if vector else residuals
    if vector:
        x = x[..., 0]
    return (
        x,
        residuals,
        rank if driver != "gels" else _empty(np.int64),
        s if driver in ("gelsd", "gelss") else _empty(real),
    )
