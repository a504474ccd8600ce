"""Lowerings: matrix products, linear algebra and distances.

Products keep torch's dtypes: bf16/fp16 accumulate in float32 and round once,
integers multiply exactly in int64 and wrap to their own width. Products are
2-D dots wherever the shapes allow (XLA on CPU runs them much faster than a
batched dot or an einsum).

Factorizations follow LAPACK's conventions (JAX calls the same routines on
CPU), so the sign and phase choices of QR, SVD and eig match torch's; eigh's
eigenvector signs can still differ (torch's MKL and jaxlib's LAPACK reduce
small matrices differently), as they may between any two LAPACK builds.
LU pivots are torch's: 1-based int32. Where torch factors ``A^T`` of a
contiguous real matrix rather than ``A`` (det, slogdet: their derivative formulas
rely on it), so do we (`_factors_transpose`).

Bad input raises torch's error. A singular or not positive-definite matrix raises
torch.linalg.LinAlgError where torch's kernel checks LAPACK's info (eagerly only: under
a trace the values are unknown); the ``_ex`` variants return that info instead, with
torch's values.
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
from ..dispatch import OpError, TorchRuntimeError, TorchValueError
from .registry import (argmax_index, canonical_dim, cast, float_abs, layout_keywords, refused_dtypes, register,
                       root_zero_slope, scalar_type_name, strides, torch_slopes)

aten = torch.ops.aten

_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


# ---------------------------------------------------------------------------
# torch's argument checks and LAPACK errors
# ---------------------------------------------------------------------------
#
# The checks are those of torch's C++ kernels, in their order and with their messages
# (torch's Python meta kernels word some differently: "Got torch.int64" for "Got Long").
# They raise TorchRuntimeError, which the dispatcher passes on as torch's own error.

# The dtypes torch's LAPACK-backed CPU kernels are compiled for
_LAPACK_DTYPES = frozenset(map(np.dtype, (np.float32, np.float64, np.complex64, np.complex128)))


class LinAlgError(TorchRuntimeError, torch.linalg.LinAlgError):
    """torch.linalg.LinAlgError, passed on by the dispatcher as torch's own error."""


def _check_matrix(shape, f_name, arg="A"):
    if len(shape) < 2:
        raise TorchRuntimeError(f"{f_name}: The input tensor {arg} must have at least 2 dimensions.")


def _check_square(shape, f_name, arg="A"):
    _check_matrix(shape, f_name, arg)
    if shape[-1] != shape[-2]:
        raise TorchRuntimeError(
            f"{f_name}: {arg} must be batches of square matrices, but they are {shape[-2]} by {shape[-1]} matrices"
        )


def _check_floating(dtype, f_name, low_precision=True):
    if not (_dt.is_floating(dtype) or _dt.is_complex(dtype)):
        raise TorchRuntimeError(
            f"{f_name}: Expected a floating point or complex tensor as input. Got {scalar_type_name(dtype)}"
        )
    if not low_precision and np.dtype(dtype) not in _LAPACK_DTYPES:
        raise TorchRuntimeError(f"{f_name}: Low precision dtypes not supported. Got {scalar_type_name(dtype)}")


def _not_implemented(kernel, dtype):
    """The error of torch's dtype dispatch for a kernel not compiled for ``dtype``."""
    return NotImplementedError(f"\"{kernel}\" not implemented for '{scalar_type_name(dtype)}'")


def _check_kernel(kernel, dtype):
    """The error of one of torch's LAPACK-backed kernels for a dtype LAPACK lacks."""
    if np.dtype(dtype) not in _LAPACK_DTYPES:
        raise _not_implemented(kernel, dtype)


def _check_solver(a_shape, b_shape, left, f_name):
    """torch's checkInputsSolver: square A, and B matrices that fit AX = B (``left``) or XA = B."""
    _check_square(a_shape, f_name)
    _check_matrix(b_shape, f_name, "B")
    if a_shape[-2 if left else -1] != b_shape[-2 if left else -1]:
        raise TorchRuntimeError(
            f"{f_name}: Incompatible shapes of A and B for the equation {'AX = B' if left else 'XA = B'} "
            f"({a_shape[-2]}x{a_shape[-1]} and {b_shape[-2]}x{b_shape[-1]})"
        )


def _check_linear_solve(b, a, name):
    """torch's linearSolveCheckInputs for the right-hand side ``b`` and the matrices ``a``."""
    if b.dtype != a.dtype:
        raise TorchRuntimeError(
            f"Expected b and A to have the same dtype, but found b of type {scalar_type_name(b.dtype)} and A of type "
            f"{scalar_type_name(a.dtype)} instead."
        )
    if a.shape[-1] != a.shape[-2]:
        raise TorchRuntimeError(
            f"A must be batches of square matrices, but they are {a.shape[-2]} by {a.shape[-1]} matrices"
        )
    n = a.shape[-1]
    if b.shape[canonical_dim(-2, b.ndim)] != n:  # b.size(-2): torch's IndexError for a vector
        raise TorchRuntimeError(
            f"Incompatible matrix sizes for {name}: each A matrix is {n} by {n} but each b matrix is "
            f"{b.shape[-2]} by {b.shape[-1]}"
        )


def _infer_size(a, b):
    """torch's broadcast of shapes ``a`` and ``b`` (infer_size), with its error."""
    ndim = max(len(a), len(b))
    a, b = (1,) * (ndim - len(a)) + tuple(a), (1,) * (ndim - len(b)) + tuple(b)
    for i in reversed(range(ndim)):
        if a[i] != b[i] and 1 not in (a[i], b[i]):
            raise TorchRuntimeError(
                f"The size of tensor a ({a[i]}) must match the size of tensor b ({b[i]}) at non-singleton dimension {i}"
            )
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def _batch_shape(a_shape, b_shape):
    """The broadcast batch dimensions (all but the last two) of two stacks of matrices."""
    return _infer_size(a_shape[:-2], b_shape[:-2])


def _traced(x):
    """Whether ``x`` is traced (jit, grad, vmap): its values cannot be read, so they are not checked."""
    return isinstance(x, jax.core.Tracer)


def _raise_for_info(info, api_name, is_matrix):
    """Eager mode: the error torch raises for LAPACK's ``info`` codes (0 where a matrix succeeded).

    torch's own check (``_linalg_check_errors`` on CPU) words it: LinAlgError for a singular or
    not positive-definite matrix, "(Batch element i)" naming the first failed one of a batch.
    Reading the codes costs a device sync, as on CUDA; the ``_ex`` variants, which return
    them instead, do not check.
    """
    if _traced(info) or info.size == 0:
        return
    codes = np.asarray(info, np.int32)
    if not codes.any():
        return
    try:
        aten._linalg_check_errors(torch.tensor(codes, device="cpu"), api_name, is_matrix=is_matrix)
    except torch.linalg.LinAlgError as e:
        raise LinAlgError(str(e)) from None
    except RuntimeError as e:  # lu_factor's error, and an internal assert for codes torch does not expect
        raise TorchRuntimeError(str(e)) from None


def _compiled(*static_argnames):
    """jax.jit for the computation of a kernel that checks LAPACK's info itself (torch.cholesky,
    cholesky_inverse, svd): reading the info keeps the dispatcher from compiling its lowering,
    and op by op a loop or a chain of small ops is slow. The computation returns the info."""
    return functools.partial(jax.jit, static_argnames=static_argnames)


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


def _check_dtypes(op, *operands):
    """torch's error, if any, for operands of mixed dtypes or of bool: ``op``, torch's CPU op,
    runs on one-element stand-ins of them, so the message names the dtypes as its kernel
    does ("float != long int", "Float and Double"). Shapes are checked before."""
    if len({np.dtype(x.dtype) for x in operands}) == 1 and operands[0].dtype != np.bool_:
        return
    try:
        op(*(torch.ones((1,) * x.ndim, dtype=_dt.to_torch(x.dtype), device="cpu") for x in operands))
    except NotImplementedError:  # a kernel without bool
        raise
    except RuntimeError as e:
        raise TorchRuntimeError(str(e)) from None


def _check_mm(a, b, addmm=False):
    """torch's shape checks of mm; addmm's name its first matrix mat1 and count dimensions."""
    for x, name in zip((a, b), ("mat1" if addmm else "self", "mat2")):
        if x.ndim != 2:
            raise TorchRuntimeError(f"{name} must be a matrix" + (f", got {x.ndim}-D tensor" if addmm else ""))
    if a.shape[1] != b.shape[0]:
        raise TorchRuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and {b.shape[0]}x{b.shape[1]})"
        )


def _check_bmm(a, b):
    for x, name in ((a, "batch1"), (b, "batch2")):
        if x.ndim != 3:
            raise TorchRuntimeError(f"{name} must be a 3D tensor")
    if b.shape[:2] != (a.shape[0], a.shape[2]):
        raise TorchRuntimeError(
            f"Expected size for first two dimensions of batch2 tensor to be: [{a.shape[0]}, {a.shape[2]}] but got: "
            f"[{b.shape[0]}, {b.shape[1]}]."
        )


def _check_expand(x, shape):
    """torch's expand of ``x`` (addmm's input) to the product's ``shape``, with its errors."""
    if x.ndim > len(shape):
        raise TorchRuntimeError(
            f"expand(torch.{scalar_type_name(x.dtype)}Tensor{{{list(x.shape)}}}, size={list(shape)}): the number of "
            f"sizes provided ({len(shape)}) must be greater or equal to the number of dimensions in the tensor "
            f"({x.ndim})"
        )
    lead = len(shape) - x.ndim
    for i in reversed(range(lead, len(shape))):
        if x.shape[i - lead] not in (1, shape[i]):
            raise TorchRuntimeError(
                f"The expanded size of the tensor ({shape[i]}) must match the existing size ({x.shape[i - lead]}) at "
                f"non-singleton dimension {i}.  Target sizes: {list(shape)}.  Tensor sizes: {list(x.shape)}"
            )


def _size(x, dim):
    """``x.size(dim)``, with torch's IndexError for a dimension ``x`` lacks."""
    return x.shape[canonical_dim(dim, x.ndim)]


def _check_addmv(self_shape, mat, vec):
    if len(self_shape) > 1 or mat.ndim != 2 or vec.ndim != 1:
        raise TorchRuntimeError(f"vector + matrix @ vector expected, got {len(self_shape)}, {mat.ndim}, {vec.ndim}")
    numel = math.prod(self_shape)
    if mat.shape[1] != vec.shape[0] or numel not in (1, mat.shape[0]):
        raise TorchRuntimeError(
            f"size mismatch, got input ({self_shape[0]}), mat ({mat.shape[0]}x{mat.shape[1]}), vec ({vec.shape[0]})"
        )


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


# dtypes whose CPU kernels hand ``alpha`` to BLAS gemm / gemv, which never reads the matrices
# when alpha is 0: a nan or inf in them leaves no trace (addmm(c, nan, nan, alpha=0) is c)
_BLAS_GEMM = frozenset({np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.complex128)})
_BLAS_GEMV = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def _add_scaled(self, product, beta, alpha, round_half=False, blas=frozenset()):
    """``beta * self + alpha * product`` in the accumulation dtype; ``self`` is ignored when beta is 0.

    ``round_half``: bf16/fp16 scalars are first rounded to the tensor's dtype (torch's gemv does).
    ``blas``: the dtypes for which an ``alpha`` of 0 ignores the product, as BLAS does.
    """
    beta, alpha = _scalar(beta, self.dtype, round_half), _scalar(alpha, self.dtype, round_half)
    if alpha == 0 and np.dtype(self.dtype) in blas:
        product = jnp.zeros_like(product)
    out = product if alpha == 1 else product * alpha
    if beta == 0:
        return jnp.broadcast_to(out, jnp.broadcast_shapes(self.shape, out.shape))
    self = self.astype(out.dtype)
    return out + (self if beta == 1 else self * beta)


@register(aten.mm.default)
def mm(a, b):
    _check_mm(a, b)
    _check_dtypes(torch.mm, a, b)
    return _finish(_mm(a, b), a.dtype)


@register(aten.mm.dtype)
def mm_dtype(a, b, out_dtype):
    _check_mm(a, b)
    _check_dtypes(torch.mm, a, b)
    return _finish(_mm(a, b), _dt.to_jax(out_dtype))


_FLOAT8 = frozenset(map(np.dtype, (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)))


def _scaled_mm_scales(a, b, scale_a, scale_b):
    """Refuse scales that are neither tensor-wise (a float32 singleton each) nor row-wise
    (float32 ``(M, 1)`` and ``(1, N)``), in torch's words."""
    tensor_wise = scale_a.size == 1 and scale_b.size == 1
    row_wise = scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
    if a.dtype in _FLOAT8 and b.dtype in _FLOAT8 and scale_a.dtype == scale_b.dtype == np.float32 \
            and (tensor_wise or row_wise):
        return
    raise TorchValueError(
        "Invalid scaling configuration.\n- For TensorWise scaling, a and b should be float8, scales should be float "
        "and singletons.\n- For RowWise scaling, a and b should be float8, scales should be float, scale_a should be "
        f"({a.shape[0]}, 1) and scale_b should be (1, {b.shape[1]}), and both should be contiguous.\nGot "
        f"mat_a.dtype()={_dt.to_torch(a.dtype)}, scale_a.dtype()={_dt.to_torch(scale_a.dtype)}, "
        f"scale_a.size()={list(scale_a.shape)}, mat_b.dtype()={_dt.to_torch(b.dtype)}, "
        f"scale_b.dtype()={_dt.to_torch(scale_b.dtype)}, scale_b.size()={list(scale_b.shape)}")


@register(aten._scaled_mm.default)
def _scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """float8 matmul, as torch's CPU kernel computes it: each operand widened to float32 and scaled
    (tensor-wise or row-wise), multiplied in float32, ``bias`` added, and for a float8 result divided
    by ``scale_result`` before the saturating cast. ``use_fast_accum`` changes nothing here.

    >>> torch._scaled_mm(a8, b8.t(), torch.tensor(0.5), torch.tensor(2.0), out_dtype=torch.bfloat16)
    """
    if a.ndim != 2 or b.ndim != 2:
        raise TorchRuntimeError(f"mat{1 if a.ndim != 2 else 2} must be a matrix")
    if a.shape[1] != b.shape[0]:
        raise TorchRuntimeError(f"mat_a and mat_b shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and "
                                f"{b.shape[0]}x{b.shape[1]})")
    _scaled_mm_scales(a, b, scale_a, scale_b)
    dtype = a.dtype if out_dtype is None else _dt.to_jax(out_dtype)
    wide = functools.partial(jnp.asarray, dtype=np.float32)
    # ((1, 1) or (M, 1) scales a's rows; (1, 1) or (1, N) b's columns)
    out = jnp.matmul(wide(a) * scale_a.reshape(-1, 1), wide(b) * scale_b.reshape(1, -1),
                     precision=lax.Precision.HIGHEST)
    if bias is not None:
        if bias.size != b.shape[1]:
            raise TorchRuntimeError(f"Bias must be size {b.shape[1]} but got {bias.size}")
        out = out + wide(bias).reshape(-1)
    if scale_result is not None and dtype in _FLOAT8:
        out = out / wide(scale_result)
    return cast(out, dtype)


refused_dtypes(aten._trilinear, kinds="b")  # (torch's CPU kernel is a bmm: no bools)


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
    _check_bmm(a, b)
    _check_dtypes(torch.bmm, a, b)
    return _finish(_bmm(a, b), a.dtype)


@register(aten.bmm.dtype)
def bmm_dtype(a, b, out_dtype):
    _check_bmm(a, b)
    _check_dtypes(torch.bmm, a, b)
    return _finish(_bmm(a, b), _dt.to_jax(out_dtype))


@register(aten.addmm.default)
def addmm(self, a, b, *, beta=1, alpha=1):
    _check_mm(a, b, addmm=True)
    _check_dtypes(torch.addmm, self, a, b)
    _check_expand(self, (a.shape[0], b.shape[1]))
    return _finish(_add_scaled(self, _mm(a, b), beta, alpha, blas=_BLAS_GEMM), a.dtype)


@register(aten.addmm.dtype)
def addmm_dtype(self, a, b, out_dtype, *, beta=1, alpha=1):
    return _finish(_add_scaled(self, _mm(a, b), beta, alpha), _dt.to_jax(out_dtype))


@register(aten.baddbmm.default)
def baddbmm(self, a, b, *, beta=1, alpha=1):
    _check_expand(self, (_size(a, 0), _size(a, 1), _size(b, 2)))
    _check_bmm(a, b)
    _check_dtypes(torch.baddbmm, self, a, b)
    return _finish(_add_scaled(self, _bmm(a, b), beta, alpha), a.dtype)


@register(aten.baddbmm.dtype)
def baddbmm_dtype(self, a, b, out_dtype, *, beta=1, alpha=1):
    return _finish(_add_scaled(self, _bmm(a, b), beta, alpha), _dt.to_jax(out_dtype))


def _check_addbmm(self, a, b):
    _check_expand(self, (_size(a, 1), _size(b, 2)))
    for x, name in ((a, "batch1"), (b, "batch2")):
        if x.ndim != 3:
            raise TorchRuntimeError(f"{name} must be a 3D tensor")
    if a.shape[0] != b.shape[0]:
        raise TorchRuntimeError(
            f"batch1 and batch2 must have same number of batches, got {a.shape[0]} and {b.shape[0]}"
        )
    if a.shape[2] != b.shape[1]:
        raise TorchRuntimeError(
            f"Incompatible matrix sizes for bmm ({a.shape[1]}x{a.shape[2]} and {b.shape[1]}x{b.shape[2]})"
        )
    _check_dtypes(torch.addbmm, self, a, b)


@register(aten.addbmm.default)
def addbmm(self, a, b, *, beta=1, alpha=1):
    """``sum_i a[i] @ b[i]`` is one 2-D product: (n, B*k) @ (B*k, m).

    bf16 / fp16 follow torch's CPU kernel instead: one rounded addmm per batch.
    """
    _check_addbmm(self, a, b)
    nb, n, k = a.shape
    m = b.shape[2]
    if a.dtype in _HALF and nb > 0:
        start = _finish(_add_scaled(self, _mm(a[0], b[0]), beta, alpha), a.dtype)

        def step(acc, ab):
            return _finish(_add_scaled(acc, _mm(*ab), 1, alpha), a.dtype), None

        return lax.scan(step, start, (a[1:], b[1:]))[0]
    lhs = jnp.transpose(a, (1, 0, 2)).reshape(n, nb * k)
    return _finish(_add_scaled(self, _mm(lhs, b.reshape(nb * k, m)), beta, alpha, blas=_BLAS_GEMM), a.dtype)


@register(aten.mv.default)
def mv(a, v):
    _check_addmv(a.shape[:1] or (1,), a, v)
    _check_dtypes(torch.mv, a, v)
    return _finish(_mm(a, v), a.dtype)


@register(aten.addmv.default)
def addmv(self, a, v, *, beta=1, alpha=1):
    _check_addmv(self.shape, a, v)
    _check_dtypes(torch.addmv, self, a, v)
    return _finish(_add_scaled(self, _mm(a, v), beta, alpha, round_half=True, blas=_BLAS_GEMV), a.dtype)


def _check_dot(a, b):
    if a.ndim != 1 or b.ndim != 1:
        raise TorchRuntimeError(f"1D tensors expected, but got {a.ndim}D and {b.ndim}D tensors")
    if a.dtype != b.dtype:
        raise TorchRuntimeError(
            f"dot : expected both vectors to have same dtype, but found {scalar_type_name(a.dtype)} and "
            f"{scalar_type_name(b.dtype)}"
        )
    if a.shape != b.shape:
        raise TorchRuntimeError(
            f"inconsistent tensor size, expected tensor [{a.shape[0]}] and src [{b.shape[0]}] to have the same "
            f"number of elements, but got {a.shape[0]} and {b.shape[0]} elements respectively"
        )
    if a.dtype == np.bool_:
        raise _not_implemented("dot", a.dtype)


@register(aten.dot.default)
def dot(a, b):
    _check_dot(a, b)
    return _finish(_mm(a, b), a.dtype)


@register(aten.vdot.default)
def vdot(a, b):
    _check_dot(a, b)
    return _finish(_mm(jnp.conj(a), b), a.dtype)


@register(aten.addr.default)
def addr(self, v1, v2, *, beta=1, alpha=1):
    for v, name in ((v1, "vec1"), (v2, "vec2")):
        if v.ndim != 1:
            raise TorchRuntimeError(f"addr: Expected 1-D argument {name}, but got {v.ndim}-D")
    _check_expand(self, v1.shape + v2.shape)
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
        raise TorchRuntimeError(f"trace: expected a matrix, but got tensor with dim {x.ndim}")
    if x.dtype == np.bool_:
        raise _not_implemented("trace", x.dtype)
    dtype = np.dtype(np.int64) if _dt.is_integral(x.dtype, include_bool=True) else np.dtype(x.dtype)
    return _finish(jnp.trace(x, dtype=_acc_dtype(dtype)), dtype)


def _check_cross(a, b, dim):
    if a.ndim != b.ndim:
        raise TorchRuntimeError("linalg.cross: inputs must have the same number of dimensions.")
    if a.ndim == 0:
        raise IndexError(f"Dimension specified as {dim} but tensor has no dimensions")
    d = canonical_dim(dim, a.ndim)
    if a.shape[d] != 3 or b.shape[d] != 3:
        raise TorchRuntimeError(
            f"linalg.cross: inputs dimension {dim} must have length 3. Got {a.shape[d]} and {b.shape[d]}"
        )
    shape = _infer_size(a.shape, b.shape)
    if a.dtype != b.dtype:
        raise TorchRuntimeError(f"expected scalar type {scalar_type_name(a.dtype)} but found {scalar_type_name(b.dtype)}")
    if a.dtype == np.bool_:
        raise _not_implemented("cross", a.dtype)
    return shape, d


@register(aten.linalg_cross.default)
def linalg_cross(a, b, *, dim=-1):
    shape, d = _check_cross(a, b, dim)
    a = jnp.broadcast_to(a, shape)
    b = jnp.broadcast_to(b, shape)

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
    return root_zero_slope(jnp.maximum(d2, 0))


@register(aten._euclidean_dist.default)
def _euclidean_dist(x1, x2):
    return _euclid_mm(x1, x2)


def _pnorm_dist(diff, p):
    """The p-norms of ``diff``'s last dimension, differentiated by JAX as torch's `_cdist_backward`: 0 where a
    distance is 0, sign(diff) for p = 1, and for p = inf every element at the maximum gets the gradient."""
    a = float_abs(diff)
    if p == 0:
        return jnp.sum(a != 0, axis=-1).astype(a.dtype)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return root_zero_slope(jnp.sum(a * a, axis=-1))
    if math.isinf(p):
        top = jax.lax.stop_gradient(jnp.max(a, axis=-1, initial=0))
        at_top = a == top[..., None]
        return top + jnp.sum(jnp.where(at_top, a - jax.lax.stop_gradient(a), 0), axis=-1)
    return root_zero_slope(jnp.sum(_dist_power(a, p), axis=-1), p)


# a ** p of a distance's |element|, with slope 0 where it is 0 (for p < 1 JAX's is infinite there)
_dist_power = torch_slopes(lambda a, p: a ** p,
                           lambda a, p: (jnp.where(a == 0, jnp.zeros((), a.dtype), p * a ** (p - 1)), None))


def _check_cdist(x1, x2, p):
    for x, name in ((x1, "X1"), (x2, "X2")):
        if x.ndim < 2:
            raise TorchRuntimeError(f"cdist only supports at least 2D tensors, {name} got: {x.ndim}D")
    if x1.shape[-1] != x2.shape[-1]:
        raise TorchRuntimeError(
            f"X1 and X2 must have the same number of columns. X1: {x1.shape[-1]} X2: {x2.shape[-1]}"
        )
    for x, name in ((x1, "X1"), (x2, "X2")):
        if not _dt.is_floating(x.dtype):
            raise TorchRuntimeError(f"cdist only supports floating-point dtypes, {name} got: {scalar_type_name(x.dtype)}")
    if p < 0:
        raise TorchRuntimeError("cdist only supports non-negative p values")
    batch = _batch_shape(x1.shape, x2.shape)
    if x1.dtype != x2.dtype:
        raise TorchRuntimeError(f"expected scalar type {scalar_type_name(x1.dtype)} but found {scalar_type_name(x2.dtype)}")
    _check_kernel("cdist", x1.dtype)
    return batch


@register(aten._cdist_forward.default)
def _cdist_forward(x1, x2, p, compute_mode):
    batch = _check_cdist(x1, x2, p)
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
    _check_kernel("pdist", x.dtype)
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
    return jnp.where(jnp.any(mask, axis=-1), argmax_index(mask, axis=-1) + 1, 0).astype(np.int32)


def _lu(a):
    """(LU, torch pivots, permutation, info) of ``a``."""
    lu, pivots, perm = lax_linalg.lu(a)
    return lu, pivots + 1, perm, _first_true(_diagonal(lu) == 0)


def _lu_of_input(a, transposed):
    """The LU factors torch's kernel takes: of ``A^T`` where ``transposed`` (see `_factors_transpose`)."""
    return _lu(_mT(a) if transposed else a)


@layout_keywords(aten._linalg_det.default, aten._linalg_slogdet.default)
def _factors_transpose(args, kwargs):
    # LAPACK is column-major: torch factors a contiguous real A as A^T, and its derivative
    # formulas for det and slogdet read the factors as that
    a = args[0]
    return {"transposed": a.is_contiguous() and not a.is_complex()}


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
    """torch's check of the info codes an ``_ex`` variant returned (linalg.inv, solve, cholesky,
    lu_factor... run the variant, then this): eager mode only, see `_raise_for_info`."""
    _raise_for_info(info, api_name, is_matrix)


# ---------------------------------------------------------------------------
# solve, inverse, determinant
# ---------------------------------------------------------------------------


@register(aten._linalg_solve_ex.default)
def _linalg_solve_ex(a, b, *, left=True, check_errors=False):
    _check_floating(a.dtype, "linalg.solve")
    if a.dtype != b.dtype:
        raise TorchRuntimeError(
            f"linalg.solve: Expected A and B to have the same dtype, but found A of type {scalar_type_name(a.dtype)} "
            f"and B of type {scalar_type_name(b.dtype)} instead"
        )
    vector = _is_vector_rhs(a, b)
    rhs_shape = b.shape + (1,) if vector else b.shape
    _check_solver(a.shape, rhs_shape, left, "linalg.solve")
    _batch_shape(rhs_shape, a.shape)
    if vector and not left:
        raise TorchRuntimeError(
            "linalg.solve: Vector broadcasting of the left hand side is not supported for left=False. "
            "In this case linalg.solve is equivalent to B / A.squeeze(-1)"
        )
    _check_kernel("lu_cpu", a.dtype)
    lu, pivots, perm, info = _lu(a)
    x = _lu_solve(lu, perm, b[..., None] if vector else b, left=left)
    return x[..., 0] if vector else x, lu, pivots, info


@register(aten.linalg_inv_ex.default)
def linalg_inv_ex(a, *, check_errors=False):
    _check_square(a.shape, "linalg.inv")
    _check_floating(a.dtype, "linalg.inv", low_precision=False)
    lu, _, perm, info = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, perm, eye), info


@register(aten._linalg_det.default)
def _linalg_det(a, *, transposed=True):
    _check_square(a.shape, "linalg.det")
    _check_floating(a.dtype, "linalg.det")
    _check_kernel("lu_cpu", a.dtype)
    lu, pivots, _, _ = _lu_of_input(a, transposed)
    return _det_from_lu(lu, pivots), lu, pivots


def _parity(pivots):
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype), axis=-1)
    return 1 - 2 * (swaps % 2)


def _det_from_lu(lu, pivots):
    return jnp.prod(_diagonal(lu), axis=-1) * _parity(pivots).astype(lu.dtype)


@register(aten._linalg_slogdet.default)
def _linalg_slogdet(a, *, transposed=True):
    _check_square(a.shape, "linalg.slogdet")
    _check_floating(a.dtype, "linalg.slogdet", low_precision=False)
    lu, pivots, _, _ = _lu_of_input(a, transposed)
    diag = _diagonal(lu)
    absdiag = jnp.abs(diag)
    logabsdet = jnp.sum(jnp.log(absdiag), axis=-1)
    unit = jnp.where(absdiag == 0, 0, diag / jnp.where(absdiag == 0, 1, absdiag).astype(diag.dtype))
    sign = jnp.prod(unit, axis=-1) * _parity(pivots).astype(diag.dtype)
    return sign, logabsdet, lu, pivots


# ---------------------------------------------------------------------------
# LU
# ---------------------------------------------------------------------------


def _check_lu(a, f_name, pivot):
    if a.ndim < 2:
        raise TorchRuntimeError(
            f"{f_name}: Expected tensor with 2 or more dimensions. Got size: {list(a.shape)} instead"
        )
    _check_kernel("lu_cpu", a.dtype)
    if not pivot:
        raise TorchRuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")


@register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    _check_lu(a, "torch.lu_factor", pivot)
    lu, pivots, _, info = _lu(a)
    return lu, pivots, info


def _unpack_lu(lu, m, n):
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    return lower, jnp.triu(lu[..., :k, :])


def _permutation_matrix(perm, dtype):
    """P with A = P L U where A[perm] = L U: P[perm[i], i] = 1."""
    return jnp.swapaxes(jax.nn.one_hot(perm, perm.shape[-1], dtype=dtype), -1, -2)


@register(aten.linalg_lu.default)
def linalg_lu(a, *, pivot=True):
    _check_lu(a, "linalg.lu", pivot)
    lu, _, perm, _ = _lu(a)
    return (_permutation_matrix(perm, a.dtype),) + _unpack_lu(lu, *a.shape[-2:])


@register(aten.lu_unpack.default)
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    if lu.ndim < 2:
        raise TorchRuntimeError(
            f"torch.lu_unpack: Expected tensor with 2 or more dimensions. Got size: {list(lu.shape)} instead"
        )
    if unpack_pivots and pivots.dtype != np.int32:
        raise TorchRuntimeError(
            "torch.lu_unpack: LU_pivots is expected to be a contiguous tensor of torch.int32 dtype.\n"
            "Note: this function is intended to be used with the output produced by torch.linalg.lu_factor"
        )
    m, n = lu.shape[-2:]
    p = _permutation_matrix(_pivots_to_perm(pivots, m), lu.dtype) if unpack_pivots else _empty(lu.dtype)
    lower, upper = _unpack_lu(lu, m, n) if unpack_data else (_empty(lu.dtype), _empty(lu.dtype))
    return p, lower, upper


def _check_lu_solve(lu, pivots, b, left):
    _check_floating(lu.dtype, "torch.linalg.lu_solve")
    if lu.dtype != b.dtype:
        raise TorchRuntimeError(
            f"linalg.lu_solve: Expected LU and B to have the same dtype, but found LU of type "
            f"{scalar_type_name(lu.dtype)} and B of type {scalar_type_name(b.dtype)} instead"
        )
    if pivots.dtype != np.int32:
        raise TorchRuntimeError("linalg.lu_solve: pivots should be a Tensor of scalar type torch.int32")
    _check_square(lu.shape, "torch.linalg.lu_solve")
    _check_solver(lu.shape, b.shape, left, "linalg.lu_solve")
    if pivots.shape[-1:] != lu.shape[-1:]:
        raise TorchRuntimeError(
            "linalg.lu_solve: Number of pivots per batch should be same as the dimension of the matrix"
        )
    if pivots.shape != lu.shape[:-1]:
        raise TorchRuntimeError(
            "linalg.lu_solve: Expected LU.shape[:-1] and pivots.shape to be the same, but got pivots with shape "
            f"{list(pivots.shape)} instead"
        )
    _batch_shape(b.shape, lu.shape)
    _check_kernel("linalg.lu_solve_cpu", lu.dtype)


@register(aten.linalg_lu_solve.default)
def linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    _check_lu_solve(lu, pivots, b, left)
    return _lu_solve(lu, _pivots_to_perm(pivots, lu.shape[-1]), b, left=left, adjoint=adjoint)


# ---------------------------------------------------------------------------
# triangular and Cholesky
# ---------------------------------------------------------------------------


@register(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    _check_solver(a.shape, b.shape, left, "linalg.solve_triangular")
    _batch_shape(b.shape, a.shape)
    _check_kernel("triangular_solve_cpu", a.dtype)
    # the result has A's dtype: torch copies B into it before solving in place
    return _tri_solve(a, cast(b, a.dtype), lower=not upper, left=left, unit=unitriangular)


def _check_solve_operands(name, ndim_message, b, a, a_name):
    """The checks of triangular_solve and cholesky_solve on B (``b``) and their matrices ``a``."""
    for x, x_name in ((b, "b"), (a, a_name)):
        if x.ndim < 2:
            raise TorchRuntimeError(ndim_message.format(x_name, x.ndim))
    _check_linear_solve(b, a, name)
    _batch_shape(b.shape, a.shape)
    _check_kernel(f"{name}_cpu", a.dtype)


@register(aten.triangular_solve.default)
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    _check_solve_operands(
        "triangular_solve", "torch.triangular_solve: Expected {} to have at least 2 dimensions, but it has {} "
        "dimensions instead", b, a, "A"
    )
    a, b = _broadcast_batch(a, b)
    x = lax_linalg.triangular_solve(
        a, b, left_side=True, lower=not upper, transpose_a=transpose, unit_diagonal=unitriangular
    )
    return x, a


def _potf2(a):
    """(L, info): LAPACK's unblocked Cholesky (potf2) of the lower triangles of ``a``.

    Column j is factored after the ones before it; its pivot a_jj - |L[j, :j]|^2 must be
    positive (and not NaN), else the factorization stops there: the pivot is left on the
    diagonal, the later columns as they were, and info is j + 1, the order of the leading
    minor that is not positive-definite. torch's LAPACK leaves these partial factors for
    matrices up to its block size; past it the unfinished columns differ, info does not.
    """
    n = a.shape[-1]
    idx = jnp.arange(n)

    def column(j, state):
        low, info = state
        row = jnp.where(idx < j, low[..., j, :], 0)  # L[j, :j], masked: later columns may hold inf
        pivot = jnp.real(low[..., j, j]) - jnp.sum(jnp.abs(row) ** 2, axis=-1)
        goes = (info == 0) & (pivot > 0)
        stops = (info == 0) & ~(pivot > 0)
        d = jnp.sqrt(jnp.where(goes, pivot, 1)).astype(a.dtype)
        done = jnp.where(idx < j, low, 0)
        sums = jnp.einsum("...ik,...k->...i", done, jnp.conj(row), precision=lax.Precision.HIGHEST)
        below = (low[..., :, j] - sums) * (1 / d)[..., None]
        factored = jnp.where(idx > j, below, jnp.where(idx == j, d[..., None], low[..., :, j]))
        stopped = jnp.where(idx == j, pivot.astype(a.dtype)[..., None], low[..., :, j])
        col = jnp.where(goes[..., None], factored, jnp.where(stops[..., None], stopped, low[..., :, j]))
        return low.at[..., :, j].set(col), jnp.where(stops, j + 1, info).astype(np.int32)

    return lax.fori_loop(0, n, column, (jnp.tril(a), jnp.zeros(a.shape[:-2], np.int32)))


def _refactor(a, lower, failed):
    partial, info = _potf2(a)
    return jnp.where(failed[..., None, None], partial, lower), jnp.where(failed, info, 0)


def _keep(a, lower, failed):
    return lower, jnp.zeros(failed.shape, np.int32)


def _read_as_hermitian(a):
    """``a``'s lower triangle mirrored (what LAPACK reads), differentiated as ``a``'s Hermitian part:
    torch's derivative of a factorization of a Hermitian matrix is Hermitian, whatever the upper
    triangle holds (under JAX's transforms, e.g. a jitted forward differentiated outside it)."""
    hermitian = (a + _mH(a)) / 2
    mirrored = jnp.tril(a) + _mH(jnp.tril(a, -1))
    return lax.stop_gradient(mirrored) + (hermitian - lax.stop_gradient(hermitian))


def _cholesky_lower(a):
    """(L, info) of the lower triangles of ``a`` as torch's LAPACK gives them: JAX's factor
    where it succeeds; where it fails JAX gives NaN, and `_potf2` redoes those matrices for
    torch's partial factor and info (only when one failed: the loop is slower). The branches
    are module functions: JAX caches their traces, so an eager call does not compile them anew."""
    if a.shape[-1] == 0:
        return a, jnp.zeros(a.shape[:-2], np.int32)
    lower = lax_linalg.cholesky(_read_as_hermitian(a), symmetrize_input=False)
    failed = jnp.any(jnp.isnan(_diagonal(lower)), axis=-1)
    return lax.cond(jnp.any(failed), _refactor, _keep, a, lower, failed)


def _cholesky(a, upper):
    """(factor, info) from the lower triangles of ``a``, or with ``upper`` U (A = U^H U) from
    the upper ones: the lower factor of A^H, whose lower triangles they are."""
    if upper:
        lower, info = _cholesky_lower(_mH(a))
        return _mH(lower), info
    return _cholesky_lower(a)


@register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    _check_square(a.shape, "linalg.cholesky")
    _check_floating(a.dtype, "linalg.cholesky")
    _check_kernel("cholesky_cpu", a.dtype)
    return _cholesky(a, upper)


_cholesky_compiled = _compiled("upper")(_cholesky)


@register(aten.cholesky.default)
def cholesky_deprecated(a, upper=False):
    """The deprecated torch.cholesky: linalg.cholesky_ex and its check in one kernel. (Named so
    that the dispatcher does not take it for the ``lax_linalg.cholesky`` that linalg.cholesky_ex
    calls, whose lowering it could then not compile.)"""
    if a.size == 0:
        return a
    _check_square(a.shape, "cholesky")
    _check_kernel("cholesky_cpu", a.dtype)
    factor, info = _cholesky_compiled(a, upper)
    _raise_for_info(info, "cholesky", a.ndim == 2)
    return factor


def _cholesky_solve(b, factor, upper):
    if upper:  # A = U^H U
        y = _tri_solve(factor, b, lower=False, adjoint=True)
        return _tri_solve(factor, y, lower=False)
    y = _tri_solve(factor, b, lower=True)
    return _tri_solve(factor, y, lower=True, adjoint=True)


@register(aten.cholesky_solve.default)
def cholesky_solve(b, factor, upper=False):
    _check_solve_operands(
        "cholesky_solve", "{} should have at least 2 dimensions, but has {} dimensions instead", b, factor, "u"
    )
    return _cholesky_solve(b, factor, upper)


@_compiled("upper")
def _cholesky_inverse_ex(factor, upper):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    # LAPACK's potri fails on the first zero on the factor's diagonal
    return _cholesky_solve(eye, factor, upper), _first_true(_diagonal(factor) == 0)


@register(aten.cholesky_inverse.default)
def cholesky_inverse(factor, upper=False):
    _check_square(factor.shape, "cholesky_inverse")
    _check_kernel("cholesky_inverse_out_cpu", factor.dtype)
    inverse, info = _cholesky_inverse_ex(factor, upper)
    _raise_for_info(info, "cholesky_inverse", factor.ndim == 2)
    return inverse


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
        imax = argmax_index(col)
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
    _check_square(a.shape, "torch.linalg.ldl_factor_ex")
    _check_floating(a.dtype, "torch.linalg.ldl_factor_ex")
    _check_kernel("ldl_factor_kernel_cpu", a.dtype)
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
    name = "torch.linalg.ldl_solve"
    _check_square(ld.shape, name)
    _check_floating(ld.dtype, name)
    _check_linear_solve(b, ld, name)
    if pivots.shape != ld.shape[:-1]:
        raise TorchRuntimeError(
            f"{name}: Expected LD.shape[:-1] and pivots.shape to be the same, but got pivots with shape "
            f"{list(pivots.shape)} instead"
        )
    if not _dt.is_integral(pivots.dtype):
        raise TorchRuntimeError(f"{name}: Expected pivots to be integers. Got {scalar_type_name(pivots.dtype)}")
    batch = _batch_shape(b.shape, ld.shape)
    _check_kernel("ldl_solve_kernel_cpu", ld.dtype)
    n = ld.shape[-1]
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


def _check_eigh(a, UPLO):
    _check_square(a.shape, "linalg.eigh")
    if len(UPLO) != 1 or UPLO.upper() not in ("L", "U"):
        raise TorchRuntimeError(f"Expected UPLO argument to be 'L' or 'U', but got {UPLO}")
    _check_kernel("linalg_eigh_cpu", a.dtype)


@register(aten._linalg_eigh.default)
def _linalg_eigh(a, UPLO="L", compute_v=True):
    _check_eigh(a, UPLO)
    vectors, values = lax_linalg.eigh(a, lower=UPLO.upper() == "L", symmetrize_input=False)
    return values, vectors if compute_v else _empty(a.dtype)


def _check_complex_type(dtype):
    """torch's eig kernels make their result dtype first: there is none for integers and bool."""
    if not (_dt.is_floating(dtype) or _dt.is_complex(dtype)):
        raise TorchRuntimeError(f"Unknown Complex ScalarType for {scalar_type_name(dtype)}")


def _column_major(t, lead=None):
    """The strides of a column-major matrix (batch) of ``t``'s shape whose columns are ``lead``
    elements apart (dense: its rows); None below 2-D."""
    if t.dim() < 2:
        return None
    rows, cols = t.shape[-2:]
    lead = lead or max(rows, 1)  # (an empty one's as torch makes it: ones)
    step, batch = max(lead * cols if rows else 0, 1), []
    for size in reversed(t.shape[:-2]):
        batch.insert(0, step)
        step *= max(size, 1)
    return (*batch, 1, lead)


@strides(aten.linalg_eig.default)
def linalg_eig_strides(args, kwargs, results):
    """torch's CPU eigenvectors are column-major (LAPACK's layout), where its meta kernel says row-major."""
    return None, _column_major(results[1])


@strides(aten._linalg_svd.default)
def _linalg_svd_strides(args, kwargs, results):
    """torch's CPU singular vectors are column-major (LAPACK's layout), where its meta kernel says
    row-major for Vh."""
    return _column_major(results[0]), None, _column_major(results[2])


@strides(aten.cholesky.default, aten.geqrf.default)
def _lapack_factor_strides(args, kwargs, results):
    """torch's CPU Tensor.cholesky() and geqrf factors are column-major (LAPACK's layout), as
    linalg.cholesky's; geqrf's tau is row-major."""
    return (_column_major(results[0]),) + (None,) * (len(results) - 1)


@register(aten.linalg_eig.default)
def linalg_eig(a):
    _check_complex_type(a.dtype)
    # eager mode: torch refuses non-finite input here (LAPACK's geev would not converge), not in eigvals
    if not _traced(a) and not bool(jnp.all(jnp.isfinite(a))):
        raise TorchRuntimeError("torch.linalg.eig: input tensor should not contain infs or NaNs.")
    _check_square(a.shape, "linalg.eig")
    _check_kernel("linalg_eig_out_cpu", a.dtype)
    values, vectors = lax_linalg.eig(a, compute_left_eigenvectors=False, enable_eigvec_derivs=True)
    return values, vectors


@register(aten._linalg_eigvals.default)
def _linalg_eigvals(a):
    _check_complex_type(a.dtype)
    _check_square(a.shape, "linalg.eigvals")
    _check_kernel("linalg_eig_out_cpu", a.dtype)
    (values,) = lax_linalg.eig(a, compute_left_eigenvectors=False, compute_right_eigenvectors=False)
    return values


def _nan_info(a):
    """LAPACK's gesdd info for each matrix: -4 where it holds NaN (refused since LAPACK 3.10)."""
    return jnp.where(jnp.any(jnp.isnan(a), axis=(-2, -1)), -4, 0).astype(np.int32)


@_compiled("full_matrices", "compute_uv")
def _svd_ex(a, full_matrices, compute_uv):
    if not compute_uv:
        s = lax_linalg.svd(a, full_matrices=False, compute_uv=False)
        return (_empty(a.dtype), s, _empty(a.dtype)), _nan_info(a)
    return tuple(lax_linalg.svd(a, full_matrices=full_matrices)), _nan_info(a)


@register(aten._linalg_svd.default)
def _linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    _check_matrix(a.shape, "linalg.svd")
    _check_floating(a.dtype, "linalg.svd")
    _check_kernel("linalg_svd_cpu", a.dtype)
    usv, info = _svd_ex(a, full_matrices, compute_uv)
    _raise_for_info(info, "linalg.svd", a.ndim == 2)
    return usv


@register(aten.linalg_qr.default)
def linalg_qr(a, mode="reduced"):
    _check_matrix(a.shape, "linalg.qr")
    _check_floating(a.dtype, "linalg.qr")
    if mode not in ("reduced", "complete", "r"):
        raise TorchRuntimeError(
            f"qr received unrecognized mode '{mode}' but expected one of 'reduced' (default), 'r', or 'complete'"
        )
    _check_kernel("geqrf_cpu", a.dtype)
    q, r = lax_linalg.qr(a, full_matrices=mode == "complete")
    return (_empty(a.dtype) if mode == "r" else q), r


@register(aten.geqrf.default)
def geqrf(a):
    if a.ndim < 2:
        raise TorchRuntimeError("torch.geqrf: input must have at least 2 dimensions.")
    _check_kernel("geqrf_cpu", a.dtype)
    h, tau = jnp.linalg.qr(a, mode="raw")
    return _mT(h), tau


def _check_householder_product(a, tau):
    name = "torch.linalg.householder_product"
    if a.ndim < 2:
        raise TorchRuntimeError(f"{name}: input must have at least 2 dimensions.")
    if a.shape[-2] < a.shape[-1]:
        raise TorchRuntimeError(f"{name}: input.shape[-2] must be greater than or equal to input.shape[-1]")
    if a.shape[-1] < tau.shape[-1]:
        raise TorchRuntimeError(f"{name}: input.shape[-1] must be greater than or equal to tau.shape[-1]")
    if a.ndim - tau.ndim != 1:
        raise TorchRuntimeError(
            f"{name}: Expected tau to have one dimension less than input, but got tau.ndim equal to {tau.ndim} "
            f"and input.ndim is equal to {a.ndim}"
        )
    if a.ndim > 2 and tau.shape[:-1] != a.shape[:-2]:
        raise TorchRuntimeError(
            f"{name}: Expected batch dimensions of tau to be equal to input.shape[:-2], but got {list(tau.shape[:-1])}"
        )
    if tau.dtype != a.dtype:
        raise TorchRuntimeError(
            f"{name}: tau dtype {scalar_type_name(tau.dtype)} does not match input dtype {scalar_type_name(a.dtype)}"
        )
    _check_kernel("orgqr_cpu", a.dtype)


@register(aten.linalg_householder_product.default)
def linalg_householder_product(a, tau):
    _check_householder_product(a, tau)
    return lax_linalg.householder_product(a, tau)


def _check_ormqr(a, tau, c, left):
    if a.ndim < 2:
        raise TorchRuntimeError("torch.ormqr: input must have at least 2 dimensions.")
    if c.ndim < 2:
        raise TorchRuntimeError("torch.ormqr: other must have at least 2 dimensions.")
    side = -2 if left else -1
    if c.shape[side] != a.shape[-2]:
        raise TorchRuntimeError(f"torch.ormqr: other.shape[{side}] must be equal to input.shape[-2]")
    if tau.shape[-1:] != (min(c.shape[side], a.shape[-1]),):
        raise TorchRuntimeError(
            f"torch.ormqr: tau.shape[-1] must be equal to min(other.shape[{side}], input.shape[-1])"
        )
    if a.ndim - tau.ndim != 1:
        raise TorchRuntimeError(
            "torch.ormqr: Expected tau to have one dimension less than input, but got tau.ndim equal to "
            f"{tau.ndim} and input.ndim is equal to {a.ndim}"
        )
    if c.ndim != a.ndim:
        raise TorchRuntimeError(
            "torch.ormqr: Expected other to have the same number of dimensions as input, but got other.ndim equal "
            f"to {c.ndim} and input.ndim is equal to {a.ndim}"
        )
    for x_name, batch in (("tau", tau.shape[:-1]), ("other", c.shape[:-2])):
        if a.ndim > 2 and batch != a.shape[:-2]:
            raise TorchRuntimeError(
                f"torch.ormqr: Expected batch dimensions of {x_name} to be equal to input.shape[:-2], but got "
                f"{list(batch)}"
            )
    for x, x_name in ((tau, "tau"), (c, "other")):
        if x.dtype != a.dtype:  # torch's message lacks the space after the first "dtype"
            raise TorchRuntimeError(
                f"torch.ormqr: Expected input and {x_name} to have the same dtype, but input has dtype"
                f"{scalar_type_name(a.dtype)} and {x_name} has dtype {scalar_type_name(x.dtype)}"
            )
    _check_kernel("ormqr_cpu", a.dtype)


@register(aten.ormqr.default)
def ormqr(a, tau, c, left=True, transpose=False):
    _check_ormqr(a, tau, c, left)
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
    return _squared(_exp_taylor(a / scale[..., None, None], 18), s)


def _square(x):
    return jnp.matmul(x, x, precision=lax.Precision.HIGHEST)


@jax.custom_vjp
def _squared(m, s):
    """Each matrix of ``m`` squared as many times as ``s`` says (a loop of data-dependent length,
    which reverse mode cannot go through: its VJP is `_squared_bwd`)."""
    def square(state):
        i, x = state
        return i + 1, jnp.where((i < s)[..., None, None], _square(x), x)

    return lax.while_loop(lambda state: jnp.any(state[0] < s), square, (jnp.zeros((), np.int32), m))[1]


def _squared_fwd(m, s):
    return _squared(m, s), (m, s)


def _squared_bwd(residuals, g):
    # Y = X X gives X the cotangent G X^T + X^T G: from the last squaring back to the first, each
    # input X_i = m squared i times computed again (a few squarings: their square costs less than
    # keeping every X_i of a loop of unknown length)
    m, s = residuals

    def back(state):
        i, g = state
        x = jnp.swapaxes(_squared(m, jnp.minimum(s, i)), -1, -2)
        return i - 1, jnp.where((i < s)[..., None, None], jnp.matmul(g, x) + jnp.matmul(x, g), g)

    g = lax.while_loop(lambda state: state[0] >= 0, back, (jnp.max(s) - 1, g))[1]
    return g, np.zeros(s.shape, jax.dtypes.float0)


_squared.defvjp(_squared_fwd, _squared_bwd)


@register(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(a):
    """torch's algorithm: the cheapest Taylor approximant accurate for each matrix's 1-norm."""
    _check_square(a.shape, "linalg.matrix_exp")
    _check_floating(a.dtype, "linalg.matrix_exp")
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


@_compiled("hermitian", "precision")
def _pinv_ex(a, atol, rtol, hermitian, precision):
    """The pseudo-inverse from an eigendecomposition (``hermitian``) or an SVD, and the SVD's info."""
    m, n = a.shape[-2:]
    real = _dt.real_of(a.dtype)
    default_rtol = jnp.asarray(np.finfo(real).eps * max(m, n), real)
    if rtol is None:
        rtol = default_rtol if atol is None else jnp.where(atol > 0, 0, default_rtol)
    atol = jnp.zeros((), real) if atol is None else jnp.asarray(atol, real)
    rtol = jnp.asarray(rtol, real)
    if a.size == 0:
        return jnp.zeros(a.shape[:-2] + (n, m), a.dtype), _nan_info(a)
    if hermitian:
        vectors, values = lax_linalg.eigh(a, symmetrize_input=False)
        s = jnp.abs(values)
        tol = jnp.maximum(atol[..., None], rtol[..., None] * jnp.max(s, axis=-1, keepdims=True))
        inv = jnp.where(s > tol, 1 / values, 0).astype(a.dtype)
        return jnp.matmul(vectors * inv[..., None, :], _mH(vectors), precision=precision), _nan_info(a)
    u, s, vh = lax_linalg.svd(a, full_matrices=False)
    tol = jnp.maximum(atol[..., None], rtol[..., None] * s[..., :1])
    inv = jnp.where(s > tol, 1 / s, 0).astype(a.dtype)
    return jnp.matmul(_mH(vh) * inv[..., None, :], _mH(u), precision=precision), _nan_info(a)


@register(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    if a.ndim < 2 or np.dtype(a.dtype) not in _LAPACK_DTYPES:
        raise TorchRuntimeError(
            f"linalg.pinv({scalar_type_name(a.dtype)}{{{list(a.shape)}}}): expected a tensor with 2 or more dimensions "
            "of float, double, cfloat or cdouble types"
        )
    if hermitian:
        _check_eigh(a, "L")
    pinv, info = _pinv_ex(a, atol, rtol, hermitian, _precision())
    if not hermitian:  # torch's eigh does not check, its SVD does
        _raise_for_info(info, "linalg.svd", a.ndim == 2)
    return pinv


def _check_lstsq(a, b, driver):
    """torch's checks, in its order; returns whether ``b`` is a vector (a stack of them)."""
    name = "torch.linalg.lstsq"
    if a.ndim < 2:
        raise TorchRuntimeError(f"{name}: input must have at least 2 dimensions.")
    if b.ndim < 1:
        raise TorchRuntimeError(f"{name}: other must have at least 1 dimension.")
    if a.dtype != b.dtype:
        raise TorchRuntimeError(
            f"{name}: Expected input and other to have the same dtype, but got input's dtype "
            f"{scalar_type_name(a.dtype)} and other's dtype {scalar_type_name(b.dtype)}"
        )
    if not 0 <= a.ndim - b.ndim <= 1:
        raise TorchRuntimeError(
            f"{name}: input.dim() must be greater or equal to other.dim() and (input.dim() - other.dim()) <= 1"
        )
    vector = _is_vector_rhs(a, b)
    if b.shape[-1 if vector else -2] != a.shape[-2]:
        raise TorchRuntimeError(f"{name}: input.size(-2) should match other.size({-1 if vector else -2})")
    if driver not in ("gels", "gelsy", "gelsd", "gelss"):
        raise TorchRuntimeError(f"{name}: parameter `driver` should be one of (gels, gelsy, gelsd, gelss)")
    if np.dtype(a.dtype) not in _LAPACK_DTYPES:
        raise TorchRuntimeError("This function doesn't handle types other than float and double")
    return vector


@strides(aten.linalg_lstsq.default)
def linalg_lstsq_strides(args, kwargs, results):
    """torch's solution is the top of LAPACK's column-major right-hand side, ``max(m, n)`` rows
    per column (no meta kernel says so)."""
    return _column_major(results[0], max(args[0].shape[-2:])), None, None, None


@register(aten.linalg_lstsq.default)
def linalg_lstsq(a, b, rcond=None, *, driver=None):
    """The minimum-norm solution from an SVD, for every driver (they agree on full-rank
    input); rank / singular values / residuals are returned where torch's driver returns them."""
    driver = driver or "gelsy"
    vector = _check_lstsq(a, b, driver)
    m, n = a.shape[-2:]
    real = _dt.real_of(a.dtype)
    # torch makes a column of every B with a dimension less than A: of a vector, and of a matrix
    # whose rows then broadcast against A's (the solution keeps that column)
    rhs = b[..., None] if b.ndim < a.ndim else b
    batch = _infer_size(a.shape[:-2], rhs.shape[:-2])
    rhs = jnp.broadcast_to(rhs, batch + (m, rhs.shape[-1]))
    if rcond is None or rcond < 0:
        rcond = np.finfo(real).eps * max(m, n)
    # A is factored over its own batch dimensions: rank and singular values keep them
    u, s, vh = lax_linalg.svd(a, full_matrices=False)
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
            r = jnp.abs(jnp.matmul(a, x, precision=_precision()) - rhs) ** 2
            residuals = jnp.sum(r, axis=-2)  # of a vector too: a column of one
    if vector:
        x = x[..., 0]
    return (
        x,
        residuals,
        rank if driver != "gels" else _empty(np.int64),
        s if driver in ("gelsd", "gelss") else _empty(real),
    )
