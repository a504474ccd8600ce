"""Linear algebra on bad input, against torch CPU: the error torch raises (its type and
message) for mismatched shapes, non-square matrices and wrong dtypes, and
torch.linalg.LinAlgError for singular / not positive-definite matrices, which the
``_ex`` variants report in their info instead (torch's info values). Under t2j.jit the
values are not known, so nothing is checked, as in the ``_ex`` variants. Valid inputs
next to the checks still give torch's results.
"""

from __future__ import annotations

import re

import pytest
import torch

import torch2jax as t2j
from programs_util import to_device
from torch2jax import dispatch
from torch2jax.ops.registry import LOWERINGS

aten = torch.ops.aten
L = torch.linalg
f16, f64, i64, c64 = torch.float16, torch.float64, torch.int64, torch.complex64
NAN, INF = float("nan"), float("inf")


def _on_jax(tree):
    return to_device(tree, "jax")


def _on_cpu(tree):
    return to_device(tree, "cpu")


@pytest.fixture(autouse=True)
def _no_host_fallback():
    with t2j.env(fallback="error"):
        yield


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _eye(n, dtype=torch.float32):
    return torch.eye(n, dtype=dtype)


def _ones(*shape, dtype=torch.float32):
    return torch.ones(*shape, dtype=dtype)


def _kind(error):
    """The exception classes a test tells apart (all are RuntimeErrors but IndexError)."""
    return tuple(isinstance(error, k) for k in (torch.linalg.LinAlgError, NotImplementedError, IndexError))


def _assert_same_error(fn, *args, **kwargs):
    """fn raises on the jax device what it raises on CPU: same class, torch's message."""
    with pytest.raises(Exception) as want:
        fn(*args, **kwargs)
    expected = want.value
    with pytest.raises(type(expected), match=f"^{re.escape(str(expected))}$") as got:
        fn(*_on_jax(args), **_on_jax(kwargs))
    assert _kind(got.value) == _kind(expected)
    return expected


def _listed(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _assert_same_result(fn, *args, **kwargs):
    want = _listed(fn(*args, **kwargs))
    got = _listed(_on_cpu(fn(*_on_jax(args), **_on_jax(kwargs))))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert w.shape == g.shape and w.dtype == g.dtype
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-4, atol=1e-5)


# -- the errors of the reports ------------------------------------------------


def test_solve_with_mismatched_rows():
    with pytest.raises(
        RuntimeError,
        match=re.escape("linalg.solve: Incompatible shapes of A and B for the equation AX = B (2x2 and 3x2)"),
    ):
        torch.linalg.solve(torch.eye(2, device="jax"), torch.ones(3, 2, device="jax"))


def test_lu_solve_with_mismatched_rows():
    lu, pivots = torch.linalg.lu_factor(torch.eye(2, device="jax"))
    with pytest.raises(
        RuntimeError,
        match=re.escape("linalg.lu_solve: Incompatible shapes of A and B for the equation AX = B (2x2 and 3x1)"),
    ):
        torch.linalg.lu_solve(lu, pivots, torch.ones(3, 1, device="jax"))


def test_inv_of_a_singular_matrix():
    with pytest.raises(
        torch.linalg.LinAlgError,
        match=re.escape(
            "linalg.inv: The diagonal element 1 is zero, the inversion could not be completed because the input "
            "matrix is singular."
        ),
    ):
        torch.linalg.inv(torch.zeros(2, 2, device="jax"))


def test_cholesky_of_a_matrix_that_is_not_positive_definite():
    with pytest.raises(
        torch.linalg.LinAlgError,
        match=re.escape(
            "linalg.cholesky: The factorization could not be completed because the input is not positive-definite "
            "(the leading minor of order 1 is not positive-definite)."
        ),
    ):
        torch.linalg.cholesky(-torch.eye(2, device="jax"))


def test_solve_with_a_singular_matrix():
    with pytest.raises(
        torch.linalg.LinAlgError,
        match=re.escape("torch.linalg.solve: The solver failed because the input matrix is singular."),
    ):
        torch.linalg.solve(torch.zeros(2, 2, device="jax"), torch.ones(2, device="jax"))


# -- shapes and dtypes ------------------------------------------------------------

_LU, _PIVOTS = torch.linalg.lu_factor(_eye(2))
_LD, _LD_PIVOTS = torch.linalg.ldl_factor(_eye(2))

# (id, fn, args, kwargs): torch rejects each
SHAPE_AND_DTYPE_ERRORS = [
    # solve
    ("solve-rows", L.solve, (_eye(2), _ones(3, 2)), {}),
    ("solve-vector-rows", L.solve, (_eye(2), _ones(3)), {}),
    ("solve-columns-left-false", L.solve, (_eye(2), _ones(2, 3)), {"left": False}),
    ("solve-vector-left-false", L.solve, (_ones(1, 1), _ones(1)), {"left": False}),
    ("solve-not-square", L.solve, (_ones(2, 3), _ones(2)), {}),
    ("solve-1d-a", L.solve, (_ones(2), _ones(2)), {}),
    ("solve-0d-b", L.solve, (_eye(2), torch.tensor(1.0)), {}),
    ("solve-int", L.solve, (_eye(2, i64), _ones(2, dtype=i64)), {}),
    ("solve-mixed-dtypes", L.solve, (_eye(2), _ones(2, dtype=f64)), {}),
    ("solve-half", L.solve, (_eye(2, f16), _ones(2, dtype=f16)), {}),
    ("solve-batch", L.solve, (_randn(3, 2, 2), _ones(4, 2, 1)), {}),
    ("solve_ex-rows", L.solve_ex, (_eye(2), _ones(3, 2)), {}),
    # inverse
    ("inv-not-square", L.inv, (_ones(2, 3),), {}),
    ("inv-1d", L.inv, (_ones(2),), {}),
    ("inv-int", L.inv, (_eye(2, i64),), {}),
    ("inv-half", L.inv, (_eye(2, f16),), {}),
    ("inv_ex-not-square", L.inv_ex, (_ones(2, 3),), {}),
    ("inverse-int", torch.inverse, (_eye(2, i64),), {}),
    ("matrix_power-negative-int", L.matrix_power, (_eye(2, i64), -1), {}),
    ("cholesky_inverse-not-square", torch.cholesky_inverse, (_ones(2, 3),), {}),
    ("cholesky_inverse-1d", torch.cholesky_inverse, (_ones(2),), {}),
    ("cholesky_inverse-int", torch.cholesky_inverse, (_eye(2, i64),), {}),
    # Cholesky
    ("cholesky-not-square", L.cholesky, (_ones(2, 3),), {}),
    ("cholesky-1d", L.cholesky, (_ones(2),), {}),
    ("cholesky-int", L.cholesky, (_eye(2, i64),), {}),
    ("cholesky-half", L.cholesky, (_eye(2, f16),), {}),
    ("cholesky_ex-not-square", L.cholesky_ex, (_ones(2, 3),), {}),
    ("torch.cholesky-not-square", torch.cholesky, (_ones(2, 3),), {}),
    ("torch.cholesky-int", torch.cholesky, (_eye(2, i64),), {}),
    # LU
    ("lu_factor-1d", L.lu_factor, (_ones(2),), {}),
    ("lu_factor-int", L.lu_factor, (_eye(2, i64),), {}),
    ("lu_factor-no-pivoting", L.lu_factor_ex, (_eye(2),), {"pivot": False}),
    ("lu-1d", L.lu, (_ones(2),), {}),
    ("lu-no-pivoting", L.lu, (_eye(2),), {"pivot": False}),
    ("lu_unpack-1d", torch.lu_unpack, (_ones(2), _PIVOTS), {}),
    ("lu_unpack-int64-pivots", torch.lu_unpack, (_LU, _PIVOTS.long()), {}),
    ("lu_solve-rows", L.lu_solve, (_LU, _PIVOTS, _ones(3, 1)), {}),
    ("lu_solve-columns-left-false", L.lu_solve, (_LU, _PIVOTS, _ones(1, 3)), {"left": False}),
    ("lu_solve-mixed-dtypes", L.lu_solve, (_LU, _PIVOTS, _ones(2, 1, dtype=f64)), {}),
    ("lu_solve-int64-pivots", L.lu_solve, (_LU, _PIVOTS.long(), _ones(2, 1)), {}),
    ("lu_solve-pivot-count", L.lu_solve, (_LU, _PIVOTS[:1], _ones(2, 1)), {}),
    ("lu_solve-pivot-batch", L.lu_solve, (_LU, _PIVOTS.expand(3, 2), _ones(2, 1)), {}),
    ("lu_solve-not-square", L.lu_solve, (_ones(2, 3), _PIVOTS, _ones(2, 1)), {}),
    ("lu_solve-1d-b", L.lu_solve, (_LU, _PIVOTS, _ones(2)), {}),
    ("lu_solve-batch", L.lu_solve, (_LU.expand(3, 2, 2), _PIVOTS.expand(3, 2), _ones(4, 2, 1)), {}),
    ("lu_solve-int", L.lu_solve, (_LU.long(), _PIVOTS, _ones(2, 1, dtype=i64)), {}),
    ("lu_solve-half", L.lu_solve, (_LU.half(), _PIVOTS, _ones(2, 1, dtype=f16)), {}),
    # triangular and Cholesky solves
    ("cholesky_solve-rows", torch.cholesky_solve, (_ones(3, 1), _eye(2)), {}),
    ("cholesky_solve-mixed-dtypes", torch.cholesky_solve, (_ones(2, 1, dtype=f64), _eye(2)), {}),
    ("cholesky_solve-not-square", torch.cholesky_solve, (_ones(2, 1), _ones(2, 3)), {}),
    ("cholesky_solve-1d-b", torch.cholesky_solve, (_ones(2), _eye(2)), {}),
    ("cholesky_solve-1d-u", torch.cholesky_solve, (_ones(2, 1), _ones(2)), {}),
    ("cholesky_solve-batch", torch.cholesky_solve, (_ones(3, 2, 1), _eye(2).expand(4, 2, 2)), {}),
    ("cholesky_solve-int", torch.cholesky_solve, (_ones(2, 1, dtype=i64), _eye(2, i64)), {}),
    ("triangular_solve-rows", torch.triangular_solve, (_ones(3, 1), _eye(2)), {}),
    ("triangular_solve-mixed-dtypes", torch.triangular_solve, (_ones(2, 1, dtype=f64), _eye(2)), {}),
    ("triangular_solve-not-square", torch.triangular_solve, (_ones(2, 1), _ones(2, 3)), {}),
    ("triangular_solve-1d-b", torch.triangular_solve, (_ones(2), _eye(2)), {}),
    ("triangular_solve-1d-a", torch.triangular_solve, (_ones(2, 1), _ones(2)), {}),
    ("triangular_solve-batch", torch.triangular_solve, (_ones(3, 2, 1), _eye(2).expand(4, 2, 2)), {}),
    ("triangular_solve-half", torch.triangular_solve, (_ones(2, 1, dtype=f16), _eye(2, f16)), {}),
    ("solve_triangular-rows", L.solve_triangular, (_eye(2), _ones(3, 1)), {"upper": True}),
    ("solve_triangular-left-false", L.solve_triangular, (_eye(2), _ones(3, 1)), {"upper": True, "left": False}),
    ("solve_triangular-not-square", L.solve_triangular, (_ones(2, 3), _ones(2, 1)), {"upper": True}),
    ("solve_triangular-1d-b", L.solve_triangular, (_eye(2), _ones(2)), {"upper": True}),
    ("solve_triangular-batch", L.solve_triangular, (_eye(2).expand(4, 2, 2), _ones(3, 2, 1)), {"upper": True}),
    ("solve_triangular-int", L.solve_triangular, (_eye(2, i64), _ones(2, 1)), {"upper": True}),
    # least squares
    ("lstsq-rows", L.lstsq, (_ones(3, 2), _ones(4, 1)), {}),
    ("lstsq-vector-rows", L.lstsq, (_ones(3, 2), _ones(4)), {}),
    ("lstsq-batched-matrix-rows", L.lstsq, (_ones(2, 3, 2), _ones(1, 3)), {}),
    ("lstsq-dimensions", L.lstsq, (_ones(4, 3, 2), _ones(3)), {}),
    ("lstsq-0d-other", L.lstsq, (_ones(3, 2), torch.tensor(1.0)), {}),
    ("lstsq-1d-input", L.lstsq, (_ones(3), _ones(3)), {}),
    ("lstsq-mixed-dtypes", L.lstsq, (_ones(3, 2), _ones(3, 1, dtype=f64)), {}),
    ("lstsq-int", L.lstsq, (_ones(3, 2, dtype=i64), _ones(3, 1, dtype=i64)), {}),
    ("lstsq-driver", L.lstsq, (_ones(3, 2), _ones(3, 1)), {"driver": "gelsx"}),
    ("lstsq-batch", L.lstsq, (_ones(4, 3, 2), _ones(2, 3, 1)), {}),
    ("lstsq-column-batch", L.lstsq, (_ones(4, 3, 2), _ones(3, 3)), {}),
    # LDL
    ("ldl_factor-int", L.ldl_factor, (_eye(2, i64),), {}),
    ("ldl_factor-half", L.ldl_factor, (_eye(2, f16),), {}),
    ("ldl_factor_ex-not-square", L.ldl_factor_ex, (_ones(2, 3),), {}),
    ("ldl_solve-rows", L.ldl_solve, (_LD, _LD_PIVOTS, _ones(3, 1)), {}),
    ("ldl_solve-mixed-dtypes", L.ldl_solve, (_LD, _LD_PIVOTS, _ones(2, 1, dtype=f64)), {}),
    ("ldl_solve-1d-b", L.ldl_solve, (_LD, _LD_PIVOTS, _ones(2)), {}),
    ("ldl_solve-pivot-shape", L.ldl_solve, (_LD, _LD_PIVOTS[:1], _ones(2, 1)), {}),
    ("ldl_solve-float-pivots", L.ldl_solve, (_LD, _LD_PIVOTS.float(), _ones(2, 1)), {}),
    ("ldl_solve-not-square", L.ldl_solve, (_ones(2, 3), _LD_PIVOTS, _ones(2, 1)), {}),
    ("ldl_solve-batch", L.ldl_solve, (_LD.expand(3, 2, 2), _LD_PIVOTS.expand(3, 2), _ones(4, 2, 1)), {}),
    ("ldl_solve-int", L.ldl_solve, (_LD.long(), _LD_PIVOTS, _ones(2, 1, dtype=i64)), {}),
    # QR and Householder reflectors
    ("householder_product-1d", L.householder_product, (_ones(3), _ones(2)), {}),
    ("householder_product-wide", L.householder_product, (_ones(2, 3), _ones(2)), {}),
    ("householder_product-long-tau", L.householder_product, (_ones(3, 2), _ones(3)), {}),
    ("householder_product-tau-dimensions", L.householder_product, (_ones(3, 2), _ones(1, 2)), {}),
    ("householder_product-tau-batch", L.householder_product, (_ones(2, 3, 2), _ones(3, 2)), {}),
    ("householder_product-mixed-dtypes", L.householder_product, (_ones(3, 2), _ones(2, dtype=f64)), {}),
    ("householder_product-int", L.householder_product, (_ones(3, 2, dtype=i64), _ones(2, dtype=i64)), {}),
    ("ormqr-1d-input", torch.ormqr, (_ones(3), _ones(2), _ones(3, 2)), {}),
    ("ormqr-1d-other", torch.ormqr, (_ones(3, 2), _ones(2), _ones(3)), {}),
    ("ormqr-other-rows", torch.ormqr, (_ones(3, 2), _ones(2), _ones(1, 2)), {}),
    ("ormqr-other-columns", torch.ormqr, (_ones(3, 2), _ones(2), _ones(3, 2)), {"left": False}),
    ("ormqr-long-tau", torch.ormqr, (_ones(3, 2), _ones(3), _ones(3, 3)), {}),
    ("ormqr-short-tau", torch.ormqr, (_ones(3, 2), _ones(1), _ones(3, 3)), {}),
    ("ormqr-tau-dimensions", torch.ormqr, (_ones(3, 2), _ones(1, 2), _ones(3, 3)), {}),
    ("ormqr-other-dimensions", torch.ormqr, (_ones(3, 2), _ones(2), _ones(1, 3, 3)), {}),
    ("ormqr-tau-batch", torch.ormqr, (_ones(2, 3, 2), _ones(3, 2), _ones(2, 3, 3)), {}),
    ("ormqr-other-batch", torch.ormqr, (_ones(2, 3, 2), _ones(2, 2), _ones(3, 3, 2)), {}),
    ("ormqr-tau-dtype", torch.ormqr, (_ones(3, 2), _ones(2, dtype=f64), _ones(3, 3)), {}),
    ("ormqr-other-dtype", torch.ormqr, (_ones(3, 2), _ones(2), _ones(3, 3, dtype=f64)), {}),
    ("ormqr-int", torch.ormqr, (_ones(3, 2, dtype=i64), _ones(2, dtype=i64), _ones(3, 3, dtype=i64)), {}),
    ("geqrf-1d", torch.geqrf, (_ones(3),), {}),
    ("geqrf-int", torch.geqrf, (_eye(2, i64),), {}),
    ("qr-int", L.qr, (_eye(2, i64),), {}),
    ("qr-mode", L.qr, (_eye(2),), {"mode": "full"}),
    ("qr-half", L.qr, (_eye(2, f16),), {}),
    # determinants, eigen- and singular values, matrix functions
    ("det-not-square", L.det, (_ones(2, 3),), {}),
    ("det-int", L.det, (_eye(2, i64),), {}),
    ("det-half", L.det, (_eye(2, f16),), {}),
    ("slogdet-not-square", L.slogdet, (_ones(2, 3),), {}),
    ("slogdet-half", L.slogdet, (_eye(2, f16),), {}),
    ("eigh-not-square", L.eigh, (_ones(2, 3),), {}),
    ("eigh-uplo", L.eigh, (_eye(2),), {"UPLO": "X"}),
    ("eigh-int", L.eigh, (_eye(2, i64),), {}),
    ("eig-int", L.eig, (_ones(2, 3, dtype=i64),), {}),
    ("eig-not-square", L.eig, (_ones(2, 3),), {}),
    ("eig-half", L.eig, (_eye(2, f16),), {}),
    ("eigvals-int", L.eigvals, (_eye(2, i64),), {}),
    ("svd-1d", L.svd, (_ones(2),), {}),
    ("svd-int", L.svd, (_eye(2, i64),), {}),
    ("svd-half", L.svd, (_eye(2, f16),), {}),
    ("pinv-1d", L.pinv, (_ones(2),), {}),
    ("pinv-half", L.pinv, (_eye(2, f16),), {}),
    ("pinv-hermitian-not-square", L.pinv, (_ones(2, 3),), {"hermitian": True}),
    ("matrix_exp-not-square", L.matrix_exp, (_ones(2, 3),), {}),
    ("matrix_exp-int", L.matrix_exp, (_eye(2, i64),), {}),
    # cross products
    ("cross-dimensions", L.cross, (_ones(2, 3), _ones(4, 1, 3)), {}),
    ("cross-length", L.cross, (_ones(3, 4), _ones(3, 4)), {}),
    ("cross-broadcast", L.cross, (_ones(2, 3), _ones(4, 3)), {}),
    ("cross-mixed-dtypes", L.cross, (_ones(3), _ones(3, dtype=f64)), {}),
    ("cross-bool", L.cross, (_ones(3, dtype=torch.bool), _ones(3, dtype=torch.bool)), {}),
    ("cross-0d", L.cross, (torch.tensor(1.0), torch.tensor(1.0)), {}),
    ("torch.cross-mixed-dtypes", torch.cross, (_ones(3), _ones(3, dtype=f64)), {"dim": 0}),
    ("vecdot-lengths", L.vecdot, (_ones(3), _ones(4)), {}),
    # products
    ("mm-shapes", torch.mm, (_ones(2, 3), _ones(2, 3)), {}),
    ("mm-1d", torch.mm, (_ones(2), _ones(2, 2)), {}),
    ("mm-mixed-dtypes", torch.mm, (_ones(2, 2), _ones(2, 2, dtype=i64)), {}),
    ("mm-bool", torch.mm, (_ones(2, 2, dtype=torch.bool), _ones(2, 2, dtype=torch.bool)), {}),
    ("matmul-shapes", torch.matmul, (_ones(2, 3), _ones(2, 3)), {}),
    ("matmul-batched-shapes", torch.matmul, (_ones(2, 2, 3), _ones(2, 2, 3)), {}),
    ("matmul-mixed-dtypes", torch.matmul, (_ones(2, 3), _ones(3, 2, dtype=f64)), {}),
    ("bmm-shapes", torch.bmm, (_ones(2, 2, 3), _ones(3, 3, 2)), {}),
    ("bmm-2d", torch.bmm, (_ones(2, 3), _ones(3, 3)), {}),
    ("bmm-mixed-dtypes", torch.bmm, (_ones(2, 2, 2, dtype=i64), _ones(2, 2, 2)), {}),
    ("addmm-input-shape", torch.addmm, (_ones(3, 3), _ones(2, 3), _ones(3, 2)), {}),
    ("addmm-1d-mat1", torch.addmm, (_ones(2, 2), _ones(2), _ones(2, 2)), {}),
    ("addmm-mixed-dtypes", torch.addmm, (_ones(2, 2), _ones(2, 3, dtype=f64), _ones(3, 2)), {}),
    ("baddbmm-input-shape", torch.baddbmm, (_ones(3, 2, 2), _ones(2, 2, 3), _ones(2, 3, 2)), {}),
    ("addbmm-batches", torch.addbmm, (_ones(2, 2), _ones(2, 2, 3), _ones(3, 3, 2)), {}),
    ("addbmm-matrices", torch.addbmm, (_ones(2, 2), _ones(2, 2, 3), _ones(2, 2, 2)), {}),
    ("mv-shapes", torch.mv, (_ones(2, 3), _ones(2)), {}),
    ("mv-mixed-dtypes", torch.mv, (_ones(2, 3), _ones(3, dtype=f64)), {}),
    ("addmv-input-shape", torch.addmv, (_ones(3), _ones(2, 3), _ones(3)), {}),
    ("dot-lengths", torch.dot, (_ones(2), _ones(3)), {}),
    ("dot-mixed-dtypes", torch.dot, (_ones(2), _ones(3, dtype=f64)), {}),
    ("dot-2d", torch.dot, (_ones(2, 2), _ones(2)), {}),
    ("dot-bool", torch.dot, (_ones(2, dtype=torch.bool), _ones(2, dtype=torch.bool)), {}),
    ("vdot-lengths", torch.vdot, (_ones(2), _ones(3)), {}),
    ("addr-2d", torch.addr, (_ones(3, 3), _ones(3, 1), _ones(3)), {}),
    ("addr-input-shape", torch.addr, (_ones(3, 3), _ones(2), _ones(3)), {}),
    ("trace-1d", torch.trace, (_ones(3),), {}),
    ("trace-bool", torch.trace, (_ones(2, 2, dtype=torch.bool),), {}),
    ("cdist-columns", torch.cdist, (_ones(2, 3), _ones(2, 4)), {}),
    ("cdist-int", torch.cdist, (_ones(2, 3, dtype=i64), _ones(2, 3, dtype=i64)), {}),
    ("cdist-mixed-dtypes", torch.cdist, (_ones(2, 3), _ones(2, 3, dtype=f64)), {}),
    ("cdist-batch", torch.cdist, (_ones(2, 2, 3), _ones(3, 2, 3)), {}),
]


@pytest.mark.parametrize(
    "fn, args, kwargs", [case[1:] for case in SHAPE_AND_DTYPE_ERRORS], ids=[case[0] for case in SHAPE_AND_DTYPE_ERRORS]
)
def test_shape_and_dtype_errors(fn, args, kwargs):
    error = _assert_same_error(fn, *args, **kwargs)
    assert not isinstance(error, torch.linalg.LinAlgError)


# -- singular and not positive-definite matrices ------------------------------------

_SINGULAR = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
_NOT_PD = torch.tensor([[1.0, 2.0], [2.0, 1.0]])  # the leading minor of order 2 is not
_NOT_PD3 = torch.tensor([[1.0, 2.0, 3.0], [2.0, 1.0, 5.0], [3.0, 5.0, 20.0]])
_NAN = torch.full((2, 2), NAN)

# (id, fn, args, kwargs): torch raises LinAlgError, or for lu_factor and eig a RuntimeError
VALUE_ERRORS = [
    ("inv", L.inv, (torch.zeros(2, 2),), {}),
    ("inv-second-pivot", L.inv, (_SINGULAR,), {}),
    ("inv-batch", L.inv, (torch.stack([_eye(2), _SINGULAR]),), {}),
    ("inverse", torch.inverse, (torch.zeros(3, 3),), {}),
    ("inv-complex", L.inv, (_SINGULAR.to(c64),), {}),
    ("solve", L.solve, (torch.zeros(2, 2), _ones(2)), {}),
    ("solve-batch", L.solve, (torch.stack([_eye(2), torch.zeros(2, 2)]), _ones(2)), {}),
    ("solve-left-false", L.solve, (_SINGULAR.to(f64), _ones(3, 2, dtype=f64)), {"left": False}),
    ("tensorsolve", L.tensorsolve, (torch.zeros(2, 3, 6), _ones(2, 3)), {}),
    ("tensorinv", L.tensorinv, (torch.zeros(4, 6, 8, 3),), {"ind": 2}),
    ("matrix_power-negative", L.matrix_power, (torch.zeros(2, 2), -1), {}),
    ("matrix_power-negative-batch", L.matrix_power, (torch.stack([_eye(2), _SINGULAR]), -2), {}),
    ("cholesky", L.cholesky, (-_eye(2),), {}),
    ("cholesky-second-minor", L.cholesky, (_NOT_PD,), {}),
    ("cholesky-third-minor", L.cholesky, (_NOT_PD3.to(f64),), {}),
    ("cholesky-batch", L.cholesky, (torch.stack([_eye(2), -_eye(2), -_eye(2)]).reshape(3, 1, 2, 2),), {}),
    ("cholesky-complex", L.cholesky, (_NOT_PD.to(c64),), {}),
    ("cholesky-nan", L.cholesky, (torch.tensor([[1.0, NAN], [NAN, 1.0]]),), {}),
    ("cholesky-upper", L.cholesky, (torch.tensor([[4.0, 100.0], [1.0, 4.0]]),), {"upper": True}),
    ("torch.cholesky", torch.cholesky, (-_eye(2),), {}),
    ("torch.cholesky-batch", torch.cholesky, (torch.stack([_eye(2), -_eye(2)]),), {}),
    ("cholesky_inverse", torch.cholesky_inverse, (torch.zeros(2, 2),), {}),
    ("cholesky_inverse-batch", torch.cholesky_inverse, (torch.stack([_eye(2), torch.zeros(2, 2)]),), {}),
    ("cholesky_inverse-upper", torch.cholesky_inverse, (torch.tensor([[1.0, 2.0], [0.0, 0.0]]),), {"upper": True}),
    ("lu_factor", L.lu_factor, (torch.zeros(2, 2),), {}),
    ("lu_factor-batch", L.lu_factor, (torch.stack([_eye(2), _SINGULAR]),), {}),
    ("lu_factor-wide", L.lu_factor, (torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]),), {}),
    ("ldl_factor", L.ldl_factor, (torch.zeros(2, 2),), {}),
    ("svd", L.svd, (_NAN,), {}),
    ("svd-batch", L.svd, (torch.stack([_eye(2), _NAN]),), {}),
    ("svdvals", L.svdvals, (torch.tensor([[NAN, INF], [0.0, 1.0]]),), {}),
    ("svd-complex", L.svd, (_NAN.to(c64),), {"full_matrices": False}),
    ("pinv", L.pinv, (_NAN,), {}),
    ("matrix_rank", L.matrix_rank, (_NAN,), {}),
    ("matrix_norm", L.matrix_norm, (_NAN,), {"ord": 2}),
    ("cond", L.cond, (_NAN,), {}),
    ("eig-nan", L.eig, (_NAN,), {}),
    ("eig-inf", L.eig, (torch.tensor([[1.0, INF], [0.0, 1.0]]),), {}),
]


@pytest.mark.parametrize("fn, args, kwargs", [case[1:] for case in VALUE_ERRORS], ids=[case[0] for case in VALUE_ERRORS])
def test_errors_for_singular_and_indefinite_matrices(fn, args, kwargs):
    _assert_same_error(fn, *args, **kwargs)


def test_no_error_where_torch_has_none():
    # potri fails on a zero on the factor's diagonal only; trtrs / potrs do not check
    _assert_same_result(torch.cholesky_inverse, -_eye(2))
    _assert_same_result(torch.cholesky_solve, _ones(2, 1), torch.tensor([[1.0, 0.0], [2.0, 3.0]]))
    _assert_same_result(L.svdvals, torch.tensor([[1.0, INF], [3.0, 4.0]]))
    # torch's eigh does not check its input, its SVD does
    _assert_same_result(L.pinv, _NAN.to(f64), hermitian=True)
    _assert_same_result(L.eigh, _NAN)
    _assert_same_result(L.solve_triangular, _eye(2, f64) * 2, _ones(2, 1, dtype=f64), upper=True)


# -- the _ex variants report instead -------------------------------------------------


@pytest.mark.parametrize(
    "a",
    [
        -_eye(2),
        _NOT_PD,
        _NOT_PD3.to(f64),
        torch.tensor([[4.0, 2.0, 3.0, 1.0], [2.0, 5.0, 1.0, 2.0], [3.0, 1.0, 1.0, 5.0], [1.0, 2.0, 5.0, 2.0]]),
        torch.tensor([[1.0, NAN], [NAN, 1.0]]),
        torch.tensor([[NAN, 1.0], [1.0, 1.0]]),
        torch.tensor([[1.0, 1.0], [1.0, INF]]),
        torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
        _NOT_PD3.to(c64),
        torch.stack([_eye(3), _NOT_PD3, -_eye(3)]),
        torch.zeros(0, 0),
        torch.zeros(2, 0, 0),
    ],
    ids=["minus-identity", "order-2", "order-2-of-3", "order-3-of-4", "nan", "nan-first", "inf", "zero-pivot",
         "complex", "batch", "empty", "empty-batch"],
)
@pytest.mark.parametrize("upper", [False, True], ids=["lower", "upper"])
def test_cholesky_ex_returns_torchs_info_and_partial_factor(a, upper):
    """LAPACK stops at the first pivot that is not positive: the columns before it are
    factored, the pivot is left on the diagonal and the rest as it was."""
    a = a.mH.contiguous() if upper else a  # the upper factor reads the upper triangles
    _assert_same_result(L.cholesky_ex, a, upper=upper)


def test_cholesky_ex_info_of_a_larger_matrix():
    x = _randn(3, 80, 80, dtype=f64)
    a = x @ x.mT
    a[1, 70, 70] = -1e6
    a[2, 3, 3] = -1.0
    want, got = L.cholesky_ex(a), L.cholesky_ex(a.to("jax"))
    assert torch.equal(got.info.cpu(), want.info) and want.info.tolist() == [0, 71, 4]
    # the factored columns are LAPACK's; past them its blocked algorithm leaves other values
    torch.testing.assert_close(got.L.cpu()[0], want.L[0])
    torch.testing.assert_close(got.L.cpu()[1, :, :70], want.L[1, :, :70])


@pytest.mark.parametrize(
    "a",
    [torch.zeros(2, 2), _SINGULAR, torch.tensor([[0.0, 1.0], [0.0, 1.0]]), torch.stack([_eye(2), _SINGULAR, _eye(2)])],
    ids=["zeros", "second-pivot", "zero-column", "batch"],
)
def test_lu_based_ex_variants_return_torchs_info(a):
    for fn, args in (
        (L.inv_ex, (a,)),
        (L.solve_ex, (a, _ones(2))),
        (L.lu_factor_ex, (a,)),
        (L.lu_factor_ex, (a[..., :1, :],)),
    ):
        want = fn(*args)
        got = fn(*_on_jax(args))
        assert torch.equal(got.info.cpu(), want.info), fn


def test_ldl_factor_ex_returns_info():
    want = L.ldl_factor_ex(torch.zeros(2, 2))
    got = L.ldl_factor_ex(torch.zeros(2, 2, device="jax"))
    assert torch.equal(got.info.cpu(), want.info) and want.info.item() == 1


# -- under jit the values are unknown: no check, as the _ex variants ---------------------


def test_no_check_under_jit():
    def run(a):
        return torch.linalg.inv(a), torch.linalg.cholesky(a), torch.linalg.cholesky_ex(a), torch.linalg.svdvals(a)

    f = t2j.jit(run, fullgraph=True)
    inverse, factor, (partial, info), s = f(-_eye(2).to("jax"))
    torch.testing.assert_close(inverse.cpu(), -_eye(2))
    assert info.item() == 1 and partial.shape == factor.shape == (2, 2)
    torch.testing.assert_close(partial.cpu(), L.cholesky_ex(-_eye(2)).L)
    _, _, (_, info), _ = f(_NOT_PD.to("jax"))
    assert info.item() == 2
    assert f.stats["traces"] == 1
    assert torch.isnan(t2j.jit(torch.linalg.svdvals)(_NAN.to("jax"))).all()


def test_checks_run_on_compiled_calls(monkeypatch):
    """Eager ops run as compiled calls from their first call here: a bad input is still refused,
    and the calls around it still compute."""
    monkeypatch.setattr(dispatch, "_COMPILE_AFTER", 0)
    a = _randn(3, 3, dtype=f64) + 3 * _eye(3, f64)
    for _ in range(3):
        _assert_same_result(L.inv, a)
        _assert_same_error(L.inv, torch.zeros(3, 3, dtype=f64))
        _assert_same_error(L.solve, a, _ones(2, dtype=f64))
        _assert_same_result(L.solve, a, _ones(3, dtype=f64))
        _assert_same_error(L.cholesky, -a @ a.mT)
        _assert_same_result(L.cholesky_ex, -a @ a.mT)


@pytest.mark.parametrize(
    "op", [aten.linalg_inv_ex.default, aten._linalg_solve_ex.default, aten.linalg_cholesky_ex.default,
           aten.linalg_lu_factor_ex.default, aten.linalg_lu_solve.default, aten.mm.default],
)
def test_ex_variants_stay_compiled(op):
    """The _ex variants do not read their info: the dispatcher compiles them (the check is an op
    of its own, _linalg_check_errors)."""
    assert dispatch._jittable(op, LOWERINGS[op])


# -- valid input next to the checks -------------------------------------------------------


def test_solve_family_values():
    a = _randn(3, 3, dtype=f64) + 3 * _eye(3, f64)
    b = _randn(2, 3, 2, dtype=f64, seed=1)
    _assert_same_result(L.solve, a, b)
    _assert_same_result(L.solve, a, b[0, :, 0])
    _assert_same_result(L.solve, a.expand(2, 3, 3), b[:, :, 0])  # a stack of vectors
    _assert_same_result(L.solve, a, b.mT, left=False)
    _assert_same_result(L.solve_ex, a, b)
    lu, pivots = L.lu_factor(a)
    for left in (True, False):
        for adjoint in (True, False):
            _assert_same_result(L.lu_solve, lu, pivots, b if left else b.mT, left=left, adjoint=adjoint)
    _assert_same_result(torch.lu_unpack, lu, pivots.long(), unpack_pivots=False)
    upper = torch.triu(a)
    _assert_same_result(torch.triangular_solve, b, upper)
    _assert_same_result(L.solve_triangular, upper, b, upper=True)
    _assert_same_result(L.solve_triangular, upper, b.mT, upper=True, left=False)
    factor = L.cholesky(a @ a.mT)
    _assert_same_result(torch.cholesky_solve, b, factor)
    _assert_same_result(torch.cholesky_inverse, factor)
    _assert_same_result(torch.cholesky_inverse, factor.mT, upper=True)
    ld, ld_pivots = L.ldl_factor(a + a.mT)
    _assert_same_result(L.ldl_solve, ld, ld_pivots.long(), b)


def test_solve_triangular_result_has_the_dtype_of_a():
    """torch copies B into a result of A's dtype (a complex B loses its imaginary part)."""
    upper = torch.triu(_randn(3, 3)) + 3 * _eye(3)
    _assert_same_result(L.solve_triangular, upper.to(f64), _randn(3, 2), upper=True)
    _assert_same_result(L.solve_triangular, upper, _randn(3, 2, dtype=c64), upper=True)
    _assert_same_result(L.solve_triangular, upper.to(c64), _randn(3, 2), upper=True)


def test_cholesky_upper_reads_the_upper_triangle():
    a = torch.tensor([[4.0, 2.0], [1.0, 5.0]])
    _assert_same_result(L.cholesky, a, upper=True)
    _assert_same_result(L.cholesky, a)
    _assert_same_result(torch.cholesky, a.mT, upper=True)
    _assert_same_result(torch.cholesky, torch.zeros(0, 3))


def test_lstsq_shapes():
    a = _randn(1, 3, 2, dtype=f64)
    for x, b in ((a, _randn(4, 3, 1, dtype=f64)), (a, _randn(1, 3, dtype=f64)), (a[0], _randn(3, dtype=f64))):
        for driver in ("gels", "gelsy", "gelsd", "gelss"):
            _assert_same_result(L.lstsq, x, b, driver=driver)
    # a B with a dimension less than A, not a stack of vectors: its rows broadcast
    b = _randn(3, 1, dtype=f64)
    want, got = L.lstsq(a, b), L.lstsq(a.to("jax"), b.to("jax"))
    assert got.solution.shape == want.solution.shape == (3, 2, 1)


def test_products_and_cross_values():
    a, b = _randn(2, 3), _randn(3, 4, seed=1)
    _assert_same_result(torch.mm, a, b)
    _assert_same_result(torch.addmm, _randn(4), a, b)
    _assert_same_result(torch.addmm, torch.tensor(2.0), a, b)
    _assert_same_result(torch.bmm, a[None], b[None])
    _assert_same_result(torch.baddbmm, _randn(1, 4), a[None], b[None])
    _assert_same_result(torch.addbmm, _randn(2, 1), a[None], b[None])
    _assert_same_result(torch.mv, a, b[:, 0])
    _assert_same_result(torch.addmv, torch.tensor([1.0]), a, b[:, 0])
    _assert_same_result(torch.addr, _randn(2, 3, dtype=f64), a[:, 0], b[:, 0])
    _assert_same_result(torch.dot, b[:, 0], b[:, 1])
    _assert_same_result(torch.mm, a.to(i64), b.to(i64))
    _assert_same_result(L.cross, _randn(1, 3), _randn(4, 3))
    _assert_same_result(L.cross, _ones(3, 2, dtype=i64), _ones(3, 2, dtype=i64), dim=0)
    _assert_same_result(torch.cdist, _randn(2, 5, 3), _randn(1, 4, 3, seed=1))


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
def test_ormqr_values(left, transpose):
    h, tau = torch.geqrf(_randn(4, 3, dtype=f64))
    c = _randn(4, 2, dtype=f64) if left else _randn(2, 4, dtype=f64)
    _assert_same_result(torch.ormqr, h, tau, c, left=left, transpose=transpose)
    _assert_same_result(L.householder_product, h, tau)
