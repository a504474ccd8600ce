"""torch.special's Bessel Y0 / Y1, modified Bessel K0 / K1 (plain and scaled), Airy Ai and orthogonal
polynomials on the jax device against torch CPU: dense grids of arguments and degrees, eager and under
t2j.jit, each through its JAX lowering (no host fallback)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import torch2jax as t2j

mpmath = pytest.importorskip("mpmath")

F32_TOL = {"atol": 1.3e-5, "rtol": 1e-5}  # the OpInfo tolerance of float32
F64_TOL = {"atol": 1e-5, "rtol": 1.3e-6}  # torch's own float64 Y1 / Airy kernels are off by up to 3e-6

UNARY = {
    "bessel_y0": lambda v: mpmath.bessely(0, v),
    "bessel_y1": lambda v: mpmath.bessely(1, v),
    "modified_bessel_k0": lambda v: mpmath.besselk(0, v),
    "modified_bessel_k1": lambda v: mpmath.besselk(1, v),
    "scaled_modified_bessel_k0": lambda v: mpmath.besselk(0, v) * mpmath.exp(v),
    "scaled_modified_bessel_k1": lambda v: mpmath.besselk(1, v) * mpmath.exp(v),
    "airy_ai": mpmath.airyai,
}

POLYNOMIALS = [
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p",
]

# Arguments: both signs, zero, the ends of each algorithm's ranges, tiny, huge, NaN and infinities (not
# subnormals: XLA's CPU backend reads them as 0, in every op).
X_UNARY = np.unique(np.concatenate([
    np.linspace(-40, 40, 1601),
    np.geomspace(1e-12, 1e6, 400),
    -np.geomspace(1e-12, 1e6, 200),
    [0.0, 1.999999, 2.0, 2.000001, 2.1, -2.1, 2.09, -2.09, 103.89, 103.9, 700.0, 705.0, 750.0, 1e10, 1e20, 1e300,
     1e-300, np.nan, np.inf, -np.inf],
]))
# Where torch CPU's float32 kernels are themselves accurate to the float32 tolerance (their phase
# x - pi/4 is rounded to float32, which past |x| ~ 100 moves Y and Ai by more).
F32_ACCURATE = 100

X_POLY = np.concatenate([
    np.linspace(-1.25, 1.25, 51),
    [-np.inf, -20.0, -3.0, -2.0, -1.5, -1.0000001, -0.99999994, 1e-20, 3e-8, 0.99999994, 1.0000001, 1.5, 2.0,
     3.0, 20.0, np.inf, np.nan],
])
N_POLY = np.array([-5, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 50, 127, 128, 129, 300, 512, 513, 1000])


@pytest.fixture(autouse=True)
def no_host_fallback():
    """Every op in these tests runs through its lowering: no host round trip, no fallback warning."""
    before = t2j.debug.counters()["host_fallbacks"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert t2j.debug.counters()["host_fallbacks"] == before
    assert not [w for w in caught if "runs on the host" in str(w.message)]


def _fn(name):
    return getattr(torch.special, name)


def _on_jax(*args):
    return [a.to("jax") if isinstance(a, torch.Tensor) else a for a in args]


def _run(name, *args, jit=False):
    """``torch.special.<name>(*args)`` on the jax device (eager, or as one t2j.jit function), as a CPU tensor."""
    fn = _fn(name)
    if jit:
        fn = t2j.jit(fn)
    out = fn(*_on_jax(*args))
    assert isinstance(out, t2j.Tensor)
    return out.cpu()


def _close(actual, expected, atol, rtol):
    return torch.isclose(actual, expected.to(actual.dtype), atol=atol, rtol=rtol, equal_nan=True)


def _report(ok, *columns):
    bad = torch.nonzero(~ok).flatten()[:8]
    return "\n".join("  ".join(f"{c.flatten()[i].item()!r}" for c in columns) for i in bad)


# -- Bessel Y, K and Airy Ai ------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_float64_matches_torch(name, jit):
    x = torch.tensor(X_UNARY, dtype=torch.float64)
    actual, expected = _run(name, x, jit=jit), _fn(name)(x)
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, equal_nan=True, **F64_TOL)


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_float64_accuracy(name):
    """Against mpmath: within a few units in the last place (relative), where torch's own kernels miss by up to 3e-6."""
    exact_fn = UNARY[name]
    grid = np.concatenate([np.linspace(-30, 30, 241), np.geomspace(1e-8, 50, 120), -np.geomspace(1e-8, 50, 60)])
    if name != "airy_ai":
        grid = grid[grid > 0]
    exact = torch.tensor([float(exact_fn(mpmath.mpf(float(v)))) for v in grid], dtype=torch.float64)
    actual = _run(name, torch.tensor(grid, dtype=torch.float64))
    # Ai's exponent (x > 0) or phase (x < 0) zeta = (2/3) |x|^1.5 carries zeta ulps of error
    tol = {"atol": 2e-14, "rtol": 5e-14} if name == "airy_ai" else {"atol": 1e-15, "rtol": 1e-14}
    torch.testing.assert_close(actual, exact, **tol)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_float32(name, jit):
    x = torch.tensor(X_UNARY, dtype=torch.float32)
    actual = _run(name, x, jit=jit)
    assert actual.dtype == torch.float32
    # computed in float64: within float32's tolerance of torch's float64 result on the same inputs ...
    torch.testing.assert_close(actual, _fn(name)(x.double()).float(), equal_nan=True, **F32_TOL)
    # ... and of torch's float32 kernel wherever that one is accurate
    near = x.abs() <= F32_ACCURATE
    torch.testing.assert_close(actual[near], _fn(name)(x)[near], equal_nan=True, **F32_TOL)


# (int32, int16, int8 and uint8 run with the slow set: CI time)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool] + [
    pytest.param(d, marks=pytest.mark.slow) for d in (torch.int32, torch.int16, torch.int8, torch.uint8)])
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_integer_and_bool_inputs(name, dtype):
    if dtype == torch.bool:
        x = torch.tensor([True, False])
    else:
        x = torch.arange(0 if dtype == torch.uint8 else -60, 61, dtype=dtype)
    actual, expected = _run(name, x), _fn(name)(x)
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected, equal_nan=True, **F32_TOL)


@pytest.mark.parametrize("name", list(UNARY) + POLYNOMIALS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.complex64])
def test_dtypes_without_a_torch_kernel_raise_as_torch(name, dtype):
    args = (torch.ones(3, dtype=dtype),) if name in UNARY else (torch.ones(3, dtype=dtype), 2)
    with pytest.raises(NotImplementedError) as torch_error:
        _fn(name)(*args)
    with pytest.raises(NotImplementedError) as ours:
        _fn(name)(*_on_jax(*args))
    assert str(ours.value) == str(torch_error.value)


# -- orthogonal polynomials ---------------------------------------------------------


def _grid(dtype, n_dtype=None):
    """x and n tensors of every pair of X_POLY and N_POLY: a degree per element."""
    x, n = np.meshgrid(X_POLY, N_POLY)
    return torch.tensor(x.ravel(), dtype=dtype), torch.tensor(n.ravel(), dtype=n_dtype or dtype)


def _check_polynomial(name, actual, x, n, tol):
    """``actual`` against torch CPU on (x, n): within ``tol`` of torch's result in x's dtype, or, where that
    one is off (the trigonometric forms for large n in float32), of torch's float64 result on the same inputs.

    For x = NaN and n >= 2 torch's kernels return an uninitialized value unless their recurrence ran:
    there we return NaN.
    """
    expected = _fn(name)(x, n)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    degree = n.double().trunc()
    undefined = x.isnan() & (degree >= 2) & (degree < 2**63)
    assert actual[undefined].isnan().all()
    ok = _close(actual, expected, **tol)
    if not x.dtype == n.dtype == torch.float64:
        ok |= _close(actual, _fn(name)(x.double(), n.double()), **tol)
    ok |= undefined
    assert ok.all(), f"{name}: x n torch ours\n" + _report(ok, x, n, expected, actual)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomial_matches_torch(name, dtype, jit):
    x, n = _grid(dtype)
    tol = {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else F32_TOL
    _check_polynomial(name, _run(name, x, n, jit=jit), x, n, tol)


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomial_recurrence_is_torchs(name):
    """Where torch runs its recurrence (no trigonometric form), ours is the same recurrence in the same
    dtype: float32 results, overflow to NaN included, agree with torch's to rounding."""
    x, n = _grid(torch.float32)
    actual, expected = _run(name, x, n), _fn(name)(x, n)
    recurrence = ~(x.isnan() & (n >= 2))
    if name.startswith(("chebyshev", "shifted")):  # their trigonometric forms start above n = 4 at the earliest
        t = 2 * x - 1 if name.startswith("shifted") else x
        recurrence &= (t.abs() >= 1) | (n <= 4)
    torch.testing.assert_close(actual[recurrence], expected[recurrence], atol=0, rtol=4e-7, equal_nan=True)


# x where sin(theta/2) (V) or cos(theta/2) (W), theta = arccos(t), rounds to 1 in x's dtype; epsneg: 1 - the
# largest float below 1. Not the shifted W in float64: its x = 1 - epsneg has t = 1 - 2 epsneg, where libm's
# rounding of arccos says no and XLA's yes.
TRIGONOMETRIC_LIMITS = {
    ("chebyshev_polynomial_v", torch.float32): [-1 + np.finfo(np.float32).epsneg],
    ("chebyshev_polynomial_v", torch.float64): [-1 + np.finfo(np.float64).epsneg],
    ("chebyshev_polynomial_w", torch.float32): [1 - np.finfo(np.float32).epsneg],
    ("chebyshev_polynomial_w", torch.float64): [1 - np.finfo(np.float64).epsneg],
    ("shifted_chebyshev_polynomial_v", torch.float32): [np.finfo(np.float32).epsneg / 2],
    ("shifted_chebyshev_polynomial_v", torch.float64): [np.finfo(np.float64).epsneg / 2],
    ("shifted_chebyshev_polynomial_w", torch.float32): [1 - np.finfo(np.float32).epsneg],
}


@pytest.mark.parametrize("name,dtype", list(TRIGONOMETRIC_LIMITS))
def test_polynomial_trigonometric_limits_are_torchs(name, dtype):
    """There torch returns the polynomial's value at the nearer end t = -1 (V) or t = 1 (W), the shifted W
    the value at the other end; so do we."""
    x = torch.tensor(TRIGONOMETRIC_LIMITS[name, dtype], dtype=dtype)
    n = torch.arange(5, 14, dtype=dtype)[:, None]
    torch.testing.assert_close(_run(name, x, n), _fn(name)(x, n), atol=0, rtol=0)


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomial_non_integer_degrees(name):
    """torch truncates a float n toward zero; NaN, infinities and degrees past int64 give 0."""
    degrees = [2.9, 7.99, -0.5, -1.5, 1e30, -1e30, float("nan"), float("inf"), float("-inf")]
    x, n = np.meshgrid(X_POLY, degrees)
    x, n = torch.tensor(x.ravel()), torch.tensor(n.ravel())
    for dtype in (torch.float32, torch.float64):
        tol = {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else F32_TOL
        _check_polynomial(name, _run(name, x.to(dtype), n.to(dtype)), x.to(dtype), n.to(dtype), tol)


# Python-scalar degrees retrace per value under jit (~35 s each jitted): every other polynomial's eager
# run is in the default set, the rest in the slow one (CI time)
@pytest.mark.parametrize("name, jit", [
    pytest.param(name, jit, id=f"{name}-{'jit' if jit else 'eager'}",
                 marks=[pytest.mark.slow] if jit or i % 2 else [])
    for i, name in enumerate(POLYNOMIALS) for jit in (False, True)
])
def test_polynomial_python_scalar_arguments(name, jit):
    x = torch.tensor(X_POLY, dtype=torch.float32)
    for degree in [-2, 1, 3, 9, 1000, 2.5]:
        expected = _fn(name)(x, degree)
        actual = _run(name, x, degree, jit=jit)
        assert actual.dtype == expected.dtype == torch.float32
        ok = _close(actual, expected, **F32_TOL) | _close(actual, _fn(name)(x.double(), degree), **F32_TOL)
        ok |= x.isnan() & (degree >= 2)
        assert ok.all(), f"{name} n={degree}: x torch ours\n" + _report(ok, x, expected, actual)
    n = torch.tensor(N_POLY)
    for value in [-1.5, -1.0, 0.0, 0.3, 1.0, 2.0]:
        expected = _fn(name)(value, n)
        actual = _run(name, value, n, jit=jit)
        assert actual.dtype == expected.dtype == torch.float32
        # torch computes in float32, from x rounded to it
        wide = _fn(name)(float(np.float32(value)), n.double())
        ok = _close(actual, expected, **F32_TOL) | _close(actual, wide, **F32_TOL)
        assert ok.all(), f"{name} x={value}: n torch ours\n" + _report(ok, n, expected, actual)


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomial_huge_degree(name):
    """n = 2**62, as a Python int (converted to x's dtype, then to int64, as torch does), where the result is
    defined by more than rounding: at the ends t = +-1, past them (overflow: NaN), and for Hermite (NaN)."""
    x = {
        "shifted": [-1.0, 0.0, 1.0, 2.0],
        "chebyshev": [-3.0, -2.0, -1.0, 1.0, 2.0, 3.0],
        "hermite": [-2.0, 0.0, 0.5, 3.0],
        "laguerre": [0.0],
        "legendre": [-1.0, 1.0],
    }[name.split("_")[0]]
    for dtype in (torch.float32, torch.float64):
        xs = torch.tensor(x, dtype=dtype)
        torch.testing.assert_close(_run(name, xs, 2**62), _fn(name)(xs, 2**62), equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize(
    "x_dtype,n_dtype",
    [
        (torch.int64, torch.int64), (torch.bool, torch.bool), (torch.int64, torch.float64),
        (torch.float32, torch.float64), (torch.bfloat16, torch.float32),
    ] + [pytest.param(*pair, marks=pytest.mark.slow) for pair in (  # (CI time)
        (torch.int32, torch.int64), (torch.float32, torch.int32), (torch.int16, torch.uint8), (torch.int8, torch.float64))],
)
@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomial_type_promotion(name, x_dtype, n_dtype):
    x = torch.tensor([True, False]) if x_dtype == torch.bool else torch.tensor([-3, -1, 0, 1, 2, 5]).to(x_dtype)
    n = torch.tensor([True, True]) if n_dtype == torch.bool else torch.tensor([0, 1, 2, 3, 7, 12]).to(n_dtype)
    expected = _fn(name)(x, n)
    actual = _run(name, x, n)
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, equal_nan=True, **F32_TOL)
    if x_dtype != torch.bfloat16:  # a 0-dim n does not promote x's dtype (bfloat16 x: torch has no kernel)
        expected = _fn(name)(x, torch.tensor(3.0, dtype=torch.float64))
        assert _run(name, x, torch.tensor(3.0, dtype=torch.float64)).dtype == expected.dtype


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomial_degree_is_traced_under_jit(name):
    """One trace serves every degree tensor: the recurrence's trip count is data-dependent."""
    fn = t2j.jit(_fn(name))
    x = torch.linspace(-1.5, 1.5, 31, dtype=torch.float64)
    for degrees in ([0, 1, 2, 3], [7, 50, 9, 1000], [513, -1, 300, 4]):
        n = torch.tensor(degrees, dtype=torch.float64).repeat(8)[:31]
        actual = fn(x.to("jax"), n.to("jax")).cpu()
        torch.testing.assert_close(actual, _fn(name)(x, n), equal_nan=True, atol=1e-10, rtol=1e-10)
    assert fn.stats["traces"] == 1


@pytest.mark.parametrize("name, dtype", [
    # (~40-100 s each: 100 shapes compile; CI has igamma and igammac in the OpInfo run)
    pytest.param(name, dtype, marks=[pytest.mark.slow])
    for name in ("igamma", "igammac") for dtype in (torch.float32, torch.float64)
])
def test_incomplete_gamma_on_opinfo_reference_inputs(name, dtype):
    # large a ~ x (where JAX's float32 series drift), zeros, infinities and NaNs in torch's order
    from torch.testing._internal.common_methods_invocations import op_db

    op = next(o for o in op_db if o.name == name)
    for s in op.reference_inputs("cpu", dtype):
        other = s.args[0]
        expected = op(s.input, other)
        actual = op(s.input.to("jax"), other.to("jax") if isinstance(other, torch.Tensor) else other)
        torch.testing.assert_close(actual.cpu(), expected, equal_nan=True, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("order", [0, 1])
def test_bessel_first_kind_float64_accurate_to_rounding(order):
    """J0 / J1 in float64 against mpmath across the series, integral and asymptotic ranges (torch
    CPU's own kernel is off by up to 4e-7 near x = 5, so it is not the reference here)."""
    mpmath = pytest.importorskip("mpmath")
    xs = np.concatenate([np.linspace(0.05, 30.0, 600), [7.999, 8.0, 19.999, 20.0, -5.04, -19.9, 1e-9]])
    fn = torch.special.bessel_j0 if order == 0 else torch.special.bessel_j1
    ours = fn(torch.tensor(xs, dtype=torch.float64, device="jax")).cpu().numpy()
    expected = np.array([float(mpmath.besselj(order, x)) for x in xs])
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-13)


def test_inplace_polygamma_is_lowered():
    # x.polygamma_(n) takes polygamma's arguments swapped: no functional variant was found, and it
    # ran on the host through torch
    x = torch.linspace(0.1, 3, 6).view(2, 3).t()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (0, 1, 3):
            on_jax = x.to("jax")
            assert on_jax.polygamma_(n) is on_jax
            torch.testing.assert_close(on_jax.cpu(), x.clone().polygamma_(n))
    with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
        torch.arange(3, device="jax").polygamma_(1)
