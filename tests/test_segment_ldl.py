"""segment_reduce (and its backward) and the LDL factorization / solve, against torch CPU.

Every op here must run through its JAX lowering: the tests run with host fallback
turned into an error, in eager mode and inside t2j.jit.
"""

from __future__ import annotations

import math

import pytest
import torch

import torch2jax as t2j
from programs_util import to_device

aten = torch.ops.aten
NAN = float("nan")


def _on_jax(tree):
    return to_device(tree, "jax")


@pytest.fixture(autouse=True)
def _no_host_fallback():
    with t2j.env(fallback="error"):
        yield


# -- segment_reduce ----------------------------------------------------------

REDUCTIONS = ("sum", "mean", "prod", "max", "min")

# (data shape, lengths, unsafe): empty segments first, last and in between; a lengths row
# per leading row of data (2-D lengths) with and without trailing data dims; lengths that
# cover only part of the axis (allowed when unsafe)
SEGMENT_CASES = [
    ((7,), [0, 2, 0, 3, 2, 0], False),
    ((10, 3, 2), [1, 2, 0, 6, 0], True),
    ((4, 6), [[2, 0, 3, 1], [0, 1, 2, 3], [6, 0, 0, 0], [1, 1, 1, 3]], False),
    ((3, 5, 2), [[2, 0, 3], [0, 5, 0], [1, 1, 3]], False),
]


def _segment_kwargs(lengths, form, initial, unsafe):
    lengths = torch.tensor(lengths)
    axis = lengths.dim() - 1
    kwargs = {"axis": axis, "unsafe": unsafe, "initial": initial}
    if form == "lengths":
        kwargs["lengths"] = lengths
    else:
        zeros = list(lengths.shape)
        zeros[axis] = 1
        kwargs["offsets"] = torch.cat((lengths.new_zeros(zeros), lengths), axis).cumsum(axis)
    return kwargs


def _data(shape, dtype, seed):
    """Random multiples of 0.5 in [-1.5, 1.5]: repeated values (ties for max / min) and zeros (prod)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype) / 2


def _run_segment(x, reduce, kwargs, grad_out):
    x = x.clone().requires_grad_()
    out = torch._segment_reduce(x, reduce, **kwargs)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    return out.detach(), grad


def _assert_same(actual, expected, dtype):
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}.get(dtype, 1e-12)
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected, atol=tol, rtol=tol, equal_nan=True)


# (the offsets form of each reduction, float64, and min, mean and prod run with the slow set: CI time)
@pytest.mark.parametrize("form", ["lengths", pytest.param("offsets", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, pytest.param(torch.float64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("reduce", ["sum", "max"] + [pytest.param(r, marks=pytest.mark.slow)
                                                     for r in ("min", "mean", "prod")])
def test_segment_reduce_values_and_grads_match_torch(reduce, dtype, form):
    for i, (shape, lengths, unsafe) in enumerate(SEGMENT_CASES):
        for initial in (None, 2, -0.5):
            kwargs = _segment_kwargs(lengths, form, initial, unsafe)
            x = _data(shape, dtype, seed=i)
            expected = torch._segment_reduce(x, reduce, **kwargs)
            grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(i)).to(dtype)
            want, want_grad = _run_segment(x, reduce, kwargs, grad_out)
            got, got_grad = _run_segment(x.to("jax"), reduce, _on_jax(kwargs), grad_out.to("jax"))
            _assert_same(got, want, dtype)
            _assert_same(got_grad, want_grad, dtype)
    assert t2j.path_of(aten.segment_reduce.default) == "lowering"
    assert t2j.path_of(aten._segment_reduce_backward.default) == "lowering"


@pytest.mark.parametrize("initial, expected", [
    (None, {"sum": 0.0, "mean": NAN, "prod": 1.0, "max": -math.inf, "min": math.inf}),
    (3, dict.fromkeys(REDUCTIONS, 3.0)),
])
def test_empty_segment_is_the_start_value(initial, expected):
    # an empty segment gets `initial`, else the identity; a mean without `initial` is NaN
    x = torch.tensor([1.0, 2.0, 4.0])
    for reduce in REDUCTIONS:
        kwargs = {"lengths": torch.tensor([2, 0, 1]), "initial": initial}
        out = torch._segment_reduce(x.to("jax"), reduce, **_on_jax(kwargs)).cpu()
        torch.testing.assert_close(out, torch._segment_reduce(x, reduce, **kwargs), equal_nan=True)
        torch.testing.assert_close(out[1], torch.tensor(expected[reduce]), equal_nan=True)


def test_mean_counts_initial_in_the_sum():
    x = torch.tensor([1.0, 3.0, 3.0, 2.0])
    lengths = torch.tensor([3, 1])
    out = torch._segment_reduce(x.to("jax"), "mean", lengths=lengths.to("jax"), initial=2)
    assert out.cpu().tolist() == torch._segment_reduce(x, "mean", lengths=lengths, initial=2).tolist()
    assert out.cpu().tolist() == [3.0, 4.0]  # (2 + 1 + 3 + 3) / 3, (2 + 2) / 1


def test_max_ties_share_only_positive_gradients():
    # torch's kernel gives every tied maximum the gradient and divides it by the number of
    # ties only where it is positive
    x = torch.tensor([3.0, 3.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    lengths = torch.tensor([3, 3, 1])
    g = torch.tensor([1.0, -2.0, 3.0])
    want = _run_segment(x, "max", {"lengths": lengths}, g)[1]
    got = _run_segment(x.to("jax"), "max", {"lengths": lengths.to("jax")}, g.to("jax"))[1].cpu()
    torch.testing.assert_close(got, want)
    assert got.tolist() == [0.5, 0.5, 0.0, -2.0, -2.0, -2.0, 3.0]


def test_extrema_propagate_nan_and_route_its_gradient():
    x = torch.tensor([1.0, NAN, 3.0, 4.0, 4.0])
    kwargs = {"lengths": torch.tensor([2, 3]), "initial": 0.0}
    for reduce in ("max", "min"):
        want, want_grad = _run_segment(x, reduce, kwargs, torch.ones(2))
        got, got_grad = _run_segment(x.to("jax"), reduce, _on_jax(kwargs), torch.ones(2, device="jax"))
        torch.testing.assert_close(got.cpu(), want, equal_nan=True)
        torch.testing.assert_close(got_grad.cpu(), want_grad, equal_nan=True)


def test_prod_gradient_with_zeros_nan_and_inf():
    # a zero or NaN element's gradient is the product of the others (and `initial`)
    x = torch.tensor([0.0, 5.0, 0.0, 0.0, 2.0, NAN, 2.0, math.inf, 0.0, 4.0, 0.5, 0.0, NAN])
    lengths = torch.tensor([2, 3, 2, 2, 4])
    for initial in (None, 3.0):
        kwargs = {"lengths": lengths, "initial": initial}
        want, want_grad = _run_segment(x, "prod", kwargs, torch.arange(1.0, 6.0))
        got, got_grad = _run_segment(x.to("jax"), "prod", _on_jax(kwargs), torch.arange(1.0, 6.0, device="jax"))
        torch.testing.assert_close(got.cpu(), want, equal_nan=True)
        torch.testing.assert_close(got_grad.cpu(), want_grad, equal_nan=True)
    assert got_grad[:2].cpu().tolist() == [15.0, 0.0]  # 3 * 5 for the zero; grad * 0 / 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_stays_half(dtype):
    x = _data((12, 3), dtype, seed=3)
    kwargs = {"lengths": torch.tensor([5, 0, 7])}
    for reduce in REDUCTIONS:
        want = torch._segment_reduce(x, reduce, **kwargs)
        _assert_same(torch._segment_reduce(x.to("jax"), reduce, **_on_jax(kwargs)), want, dtype)


@pytest.mark.parametrize("bad", [
    {"lengths": torch.tensor([2, -1, 4])},  # negative length
    {"lengths": torch.tensor([2, 2])},  # lengths must cover the axis unless unsafe
    {"lengths": torch.tensor([[2, 3]]), "axis": 0},  # axis must be the last dim of lengths
    {"offsets": torch.tensor([0, 4, 2, 5]), "unsafe": True},  # decreasing offsets
    {"lengths": torch.tensor([2.0, 3.0])},  # lengths must be integers
    {},  # neither lengths nor offsets
])
def test_segment_reduce_rejects_what_torch_rejects(bad):
    x = torch.arange(5.0)
    with pytest.raises(RuntimeError):
        torch._segment_reduce(x, "sum", **bad)
    with pytest.raises(RuntimeError):
        torch._segment_reduce(x.to("jax"), "sum", **_on_jax(bad))


def test_segment_reduce_rejects_integer_data():
    for device in ("cpu", "jax"):  # torch's error, as its CPU kernel raises it
        with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
            torch._segment_reduce(torch.arange(4, device=device), "sum", lengths=torch.tensor([4], device=device))


@pytest.mark.parametrize("form", ["lengths", "offsets"])
def test_segment_reduce_under_jit_with_traced_lengths(form):
    # lengths are an input of the program: new values of the same shape reuse the trace
    def step(x, bounds):
        kwargs = {form: bounds, "axis": 1, "initial": 0.5}
        out = torch._segment_reduce(x, "max", **kwargs) + torch._segment_reduce(x, "mean", **kwargs)
        (grad,) = torch.autograd.grad((out * out).sum(), x)
        return out, grad

    f = t2j.jit(step, fullgraph=True)
    for i, lengths in enumerate(([[2, 0, 3, 1], [0, 1, 2, 3]], [[1, 4, 0, 1], [6, 0, 0, 0]])):
        x = _data((2, 6, 3), torch.float32, seed=i).requires_grad_()
        bounds = _segment_kwargs(lengths, form, None, False)[form]
        want = step(x, bounds)
        got = f(x.detach().to("jax").requires_grad_(), bounds.to("jax"))
        for g, w in zip(got, want):
            _assert_same(g, w.detach(), torch.float32)
    assert f.stats["traces"] == 1


# -- LDL ---------------------------------------------------------------------

# (complex64 runs with the slow set: CI time; complex128 covers the complex pivots)
LDL_DTYPES = (torch.float32, torch.float64, pytest.param(torch.complex64, marks=pytest.mark.slow), torch.complex128)


def _symmetric(shape, dtype, hermitian, seed):
    """Random symmetric (Hermitian) indefinite matrices: Bunch-Kaufman picks 2x2 blocks and interchanges."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=g, dtype=dtype)
    return a + (a.mH if hermitian else a.mT)


def _tol(dtype):
    return (1e-4, 1e-4) if dtype in (torch.float32, torch.complex64) else (1e-10, 1e-10)


def _hermitian_flags(dtype):
    return (False, True) if dtype.is_complex else (False,)


@pytest.mark.parametrize("dtype", LDL_DTYPES)
def test_ldl_factor_matches_lapack_pivots(dtype):
    two_by_two = 0
    for n in (1, 5, 16):
        for hermitian in _hermitian_flags(dtype):
            a = _symmetric((6, n, n), dtype, hermitian, seed=n)
            ld, pivots, info = torch.linalg.ldl_factor_ex(a, hermitian=hermitian)
            got = torch.linalg.ldl_factor_ex(a.to("jax"), hermitian=hermitian)
            assert torch.equal(got.pivots.cpu(), pivots), (n, hermitian)
            assert torch.equal(got.info.cpu(), info)
            atol, rtol = _tol(dtype)
            torch.testing.assert_close(got.LD.cpu(), ld, atol=atol, rtol=rtol)
            two_by_two += int((pivots < 0).sum())
    assert two_by_two > 0  # the samples exercise 2x2 blocks
    assert t2j.path_of(aten.linalg_ldl_factor_ex.default) == "lowering"


def test_ldl_factor_2x2_block_and_interchange():
    # column 0 has a zero diagonal: a 2x2 block (0, 1), then a 1x1 pivot swapped with row 3
    a = torch.tensor([[0.0, 1.0, 0.0, 0.0],
                      [1.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.1, 2.0],
                      [0.0, 0.0, 2.0, 3.0]], dtype=torch.float64)
    ld, pivots, info = torch.linalg.ldl_factor_ex(a)
    got = torch.linalg.ldl_factor_ex(a.to("jax"))
    assert got.pivots.cpu().tolist() == pivots.tolist() == [-2, -2, 4, 4]
    torch.testing.assert_close(got.LD.cpu(), ld)
    assert got.info.item() == info.item() == 0


@pytest.mark.parametrize("a", [
    torch.zeros(3, 3),
    torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
    torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [3.0, 6.0, 9.0]]),
])
def test_ldl_factor_of_singular_matrix_reports_info(a):
    ld, pivots, info = torch.linalg.ldl_factor_ex(a)
    got = torch.linalg.ldl_factor_ex(a.to("jax"))
    assert info.item() > 0
    assert got.info.item() == info.item()
    assert torch.equal(got.pivots.cpu(), pivots)
    torch.testing.assert_close(got.LD.cpu(), ld)


@pytest.mark.parametrize("dtype", LDL_DTYPES)
def test_ldl_factor_with_nan_diagonal_follows_mkl(dtype):
    # MKL's real routines pivot past a NaN diagonal, its complex ones stop there (info = 1)
    a = torch.tensor([[NAN, 0.0, 0.0], [0.5, 1.0, 0.0], [2.0, 0.0, 3.0]]).to(dtype)
    for hermitian in _hermitian_flags(dtype):
        ld, pivots, info = torch.linalg.ldl_factor_ex(a, hermitian=hermitian)
        got = torch.linalg.ldl_factor_ex(a.to("jax"), hermitian=hermitian)
        assert got.pivots.cpu().tolist() == pivots.tolist()
        assert got.info.item() == info.item() == (1 if dtype.is_complex else 3)
        torch.testing.assert_close(got.LD.cpu(), ld, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_ldl_factor_hermitian_reads_the_lower_triangle_only(dtype):
    # upper triangle and imaginary diagonal parts are ignored; symmetric != Hermitian factors
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 6, 6, generator=g, dtype=dtype)
    for hermitian in (True, False):
        ld, pivots, info = torch.linalg.ldl_factor_ex(a, hermitian=hermitian)
        got = torch.linalg.ldl_factor_ex(a.to("jax"), hermitian=hermitian)
        assert torch.equal(got.pivots.cpu(), pivots)
        atol, rtol = _tol(dtype)
        torch.testing.assert_close(got.LD.cpu(), ld, atol=atol, rtol=rtol)
    assert bool((got.LD.cpu().diagonal(dim1=-2, dim2=-1).imag != 0).any())  # the symmetric factor is complex


@pytest.mark.parametrize("dtype", [LDL_DTYPES[0], *(pytest.param(d, marks=pytest.mark.slow) for d in LDL_DTYPES[1:])])
def test_ldl_solve_matches_torch(dtype):  # (~15 s each: CI runs the first dtype)
    # batch dimensions broadcast both ways (torch's CPU kernel crashes on B with more batch
    # dimensions than a batched LD, so those shapes are not compared)
    two_by_two = 0
    for hermitian in _hermitian_flags(dtype):
        for a_batch, b_batch in (((3,), ()), ((), (2, 3))):
            a = _symmetric(a_batch + (7, 7), dtype, hermitian, seed=1)
            ld, pivots = torch.linalg.ldl_factor(a, hermitian=hermitian)
            two_by_two += int((pivots < 0).sum())
            b = torch.randn(b_batch + (7, 4), generator=torch.Generator().manual_seed(2), dtype=dtype)
            want = torch.linalg.ldl_solve(ld, pivots, b, hermitian=hermitian)
            # factors from torch's CPU factorization, and from ours
            from_torch = torch.linalg.ldl_solve(ld.to("jax"), pivots.to("jax"), b.to("jax"), hermitian=hermitian)
            ld_j, piv_j = torch.linalg.ldl_factor(a.to("jax"), hermitian=hermitian)
            got = torch.linalg.ldl_solve(ld_j, piv_j, b.to("jax"), hermitian=hermitian)
            atol, rtol = _tol(dtype)
            assert got.shape == want.shape
            torch.testing.assert_close(from_torch.cpu(), want, atol=atol, rtol=rtol)
            torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)
            torch.testing.assert_close(a @ got.cpu(), b.expand(want.shape), atol=atol * 10, rtol=rtol * 10)
    assert two_by_two > 0
    assert t2j.path_of(aten.linalg_ldl_solve.default) == "lowering"


def test_ldl_solve_broadcasts_b_batch_past_ld_batch():
    a = _symmetric((3, 5, 5), torch.float64, False, seed=4)
    b = torch.randn(2, 1, 5, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ld, pivots = torch.linalg.ldl_factor(a.to("jax"))
    x = torch.linalg.ldl_solve(ld, pivots, b.to("jax")).cpu()
    assert x.shape == (2, 3, 5, 2)
    torch.testing.assert_close(a @ x, b.expand(2, 3, 5, 2))


def test_ldl_empty_inputs():
    for shape in ((0, 0), (0, 2, 2)):
        a = torch.zeros(shape)
        ld, pivots, info = torch.linalg.ldl_factor_ex(a)
        got = torch.linalg.ldl_factor_ex(a.to("jax"))
        assert got.LD.shape == ld.shape and got.pivots.shape == pivots.shape and got.info.shape == info.shape
        assert got.pivots.dtype == pivots.dtype == torch.int32
        b = torch.zeros(shape[:-1] + (3,))
        assert torch.linalg.ldl_solve(got.LD, got.pivots, b.to("jax")).shape == b.shape


def test_ldl_factor_and_solve_under_jit():
    def solve(a, b):
        ld, pivots, info = torch.linalg.ldl_factor_ex(a)
        return torch.linalg.ldl_solve(ld, pivots, b), pivots, info

    f = t2j.jit(solve, fullgraph=True)
    for seed in (0, 1):
        a = _symmetric((4, 6, 6), torch.float64, False, seed)
        b = torch.randn(4, 6, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        x, pivots, info = f(a.to("jax"), b.to("jax"))
        want_x, want_pivots, want_info = solve(a, b)
        assert torch.equal(pivots.cpu(), want_pivots) and torch.equal(info.cpu(), want_info)
        torch.testing.assert_close(x.cpu(), want_x)
    assert f.stats["traces"] == 1
