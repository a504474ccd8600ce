"""torch semantics that OpInfo samples rarely reach: type promotion with Python
scalars and zero-dim tensors, integer division and overflow, NaN / inf, empty
tensors, broadcasting."""

from __future__ import annotations

import itertools

import warnings

import pytest
import torch

import torch2jax  # noqa: F401

DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


def _make(dtype, shape):
    if dtype == torch.bool:
        return torch.tensor([True, False, True])[: shape[0]].reshape(shape) if shape else torch.tensor(True)
    return (torch.arange(1, 4) if shape else torch.tensor(2)).to(dtype).reshape(shape)


def _promotion_cases():
    for da, db, zero_dim in itertools.product(DTYPES, DTYPES, (False, True)):
        yield pytest.param(da, db, zero_dim)


@pytest.mark.parametrize("da,db,zero_dim", list(_promotion_cases()))
def test_binary_promotion(da, db, zero_dim):
    a = _make(da, (3,))
    b = _make(db, () if zero_dim else (3,))
    for op in (torch.add, torch.mul):
        expected = op(a, b)
        actual = op(a.to("jax"), b.to("jax"))
        assert actual.dtype == expected.dtype, (op, da, db)
        _assert_same_values(actual.cpu(), expected)


def _assert_same_values(actual, expected):
    if expected.dtype == torch.complex32:  # torch's CPU kernels do not compare complex32
        actual, expected = actual.to(torch.complex64), expected.to(torch.complex64)
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scalar", [2, 2.5, True, 1 + 2j])
def test_python_scalar_promotion(dtype, scalar):
    a = _make(dtype, (3,))
    try:
        expected = a * scalar
    except RuntimeError:
        return
    actual = a.to("jax") * scalar
    assert actual.dtype == expected.dtype
    _assert_same_values(actual.cpu(), expected)


def test_integer_division_and_remainder_with_negatives():
    a = torch.tensor([-7, 7, -7, 7, 0])
    b = torch.tensor([2, -2, -2, 2, 3])
    ja, jb = a.to("jax"), b.to("jax")
    for fn in (
        lambda x, y: torch.div(x, y, rounding_mode="floor"),
        lambda x, y: torch.div(x, y, rounding_mode="trunc"),
        lambda x, y: x / y,
        lambda x, y: x // y,
        lambda x, y: x % y,
        torch.fmod,
        torch.remainder,
    ):
        e, r = fn(a, b), fn(ja, jb)
        assert r.dtype == e.dtype
        torch.testing.assert_close(r.cpu(), e)


def test_integer_overflow_wraps():
    a = torch.tensor([2**31 - 1], dtype=torch.int32)
    assert (a.to("jax") + 1).cpu().item() == (a + 1).item()
    b = torch.tensor([250], dtype=torch.uint8)
    assert (b.to("jax") + 10).cpu().item() == (b + 10).item()


def _edge_ints(dtype, *rows):
    return [torch.tensor(r, dtype=dtype) for r in rows]


INTEGER_EDGES = {
    # the most negative value, whose absolute value wraps to itself (jnp.gcd never returned)
    "gcd_min": lambda d: torch.gcd(*_edge_ints(d, [torch.iinfo(d).min, torch.iinfo(d).min, 12, 0, 7],
                                               [6, 0, -18, -5, torch.iinfo(d).min])),
    "lcm_overflow": lambda d: torch.lcm(*_edge_ints(d, [torch.iinfo(d).max, 4, -4, 0], [6, 6, 6, 3])),
    "pow_tensor_exponent_top_bit": lambda d: torch.pow(*_edge_ints(d, [3], [5, 7, torch.iinfo(d).max, 2])),
    "scalar_base_pow": lambda d: 2 ** _edge_ints(d, [7, 8, 100, torch.iinfo(d).max])[0],
}


@pytest.mark.parametrize("name", sorted(INTEGER_EDGES))
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64], ids=str)
def test_integer_edge_values_match_torch(name, dtype):
    expected = INTEGER_EDGES[name](dtype)
    actual = _on_jax(INTEGER_EDGES[name], dtype)
    assert actual.dtype == expected.dtype
    assert actual.cpu().tolist() == expected.tolist()


def _on_jax(fn, dtype):
    """``fn(dtype)`` with the tensors it makes on the jax device."""
    original = torch.tensor

    def on_jax(*args, **kwargs):
        return original(*args, **kwargs).to("jax")

    torch.tensor = on_jax
    try:
        return fn(dtype)
    finally:
        torch.tensor = original


def test_integer_to_a_negative_python_power_raises_for_every_integer_dtype():
    for dtype in (torch.uint8, torch.int8, torch.int64):
        x = torch.tensor([1, 2, 3], dtype=dtype)
        with pytest.raises(RuntimeError, match="negative integer powers"):
            x ** -1
        with pytest.raises(RuntimeError, match="negative integer powers"):
            x.to("jax") ** -1


def test_nan_and_inf():
    x = torch.tensor([float("nan"), 1.0, float("inf"), -float("inf")])
    jx = x.to("jax")
    torch.testing.assert_close(torch.maximum(jx, jx.flip(0)).cpu(), torch.maximum(x, x.flip(0)), equal_nan=True)
    torch.testing.assert_close(jx.clamp(0, 2).cpu(), x.clamp(0, 2), equal_nan=True)
    assert torch.isnan(jx.max()).item() and torch.isnan(jx.sum()).item()
    torch.testing.assert_close((jx * 0).cpu(), x * 0, equal_nan=True)


def test_empty_and_zero_size():
    x = torch.zeros(0, 3, device="jax")
    assert (x + 1).shape == (0, 3)
    assert x.sum().item() == 0.0
    assert x.sum(0).shape == (3,)
    assert torch.cat([x, torch.ones(2, 3, device="jax")]).shape == (2, 3)


def test_broadcasting():
    a, b = torch.randn(4, 1, 3), torch.randn(5, 1)
    torch.testing.assert_close((a.to("jax") - b.to("jax")).cpu(), a - b)


def _eager_and_jitted(fn, x):
    """``fn(x)`` on the jax device: eagerly (past the per-signature compile threshold) and under t2j.jit."""
    eager = [fn(x.to("jax")) for _ in range(4)][-1].cpu()
    return eager, torch2jax.jit(fn)(x.to("jax")).cpu()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, marks=pytest.mark.slow), torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_division_by_a_scalar_is_correctly_rounded(dtype):
    # XLA would multiply by the reciprocal (49 * (1/49) < 1 in float64): truncating, flooring
    # or converting the quotient to an integer then loses one
    x = (torch.arange(1.0, 200.0, dtype=torch.float64) * 49).to(dtype)
    for fn in (lambda a: torch.div(a, 49.0, rounding_mode="trunc"), lambda a: (a / 49.0).floor(),
               lambda a: (a / torch.tensor(49.0, dtype=a.dtype, device=a.device)).long(),
               lambda a: torch.div(a, 49.0, rounding_mode="floor"), lambda a: a[:1] / 49.0):
        expected = fn(x)
        for actual in _eager_and_jitted(fn, x):
            assert torch.equal(actual, expected)


def test_float_to_integer_conversion_wraps_like_torch_cpu():
    # torch CPU converts through int32 (int64 for int64): out of range or NaN gives its minimum,
    # and narrower types keep the low bits; XLA's conversion would saturate
    x = torch.tensor([1e10, 300.0, -1.0, 3e9, float("nan"), float("inf"), -2.7, 2.7, 2.0**31, -(2.0**31)])
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        for src in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            expected = x.to(src).to(dtype)
            for actual in _eager_and_jitted(lambda t: t.to(dtype), x.to(src)):
                assert torch.equal(actual, expected), (src, dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
@pytest.mark.parametrize("args", [(0.0, -8.000001, -4.0), (1.0, 5.000001, 2.0), (-0.9, 2.1, 2.0), (2.1, -2.9, -1.0),
                                  (3.1,), (0, 10, 3)])
def test_integer_arange_truncates_its_arguments_like_torch(dtype, args):
    # torch truncates start, end and step to integers; int64 counts the length in integers
    expected = torch.arange(*args, dtype=dtype)
    assert torch.equal(torch.arange(*args, dtype=dtype, device="jax").cpu(), expected)


@pytest.mark.parametrize("fn", [torch.linspace, torch.logspace])
@pytest.mark.parametrize("dtype", [torch.int64, *(pytest.param(d, marks=pytest.mark.slow) for d in (
    torch.int32, torch.uint8, torch.float16, torch.bfloat16)), torch.float32])  # (~17 s each; CI: int64, float32)
def test_linspace_logspace_match_torch_cpu(fn, dtype):
    # the ends converted to the output type first, two halves counted from each end
    for start, end, steps in [(0, 50, 50), (4.3, 1, 50), (-3, 7.9, 17), (1.2, 2, 5), (50, 1, 50), (0.5, 0.5, 1)]:
        if dtype == torch.uint8 and fn is torch.linspace and min(start, end) < 0:
            continue
        expected = fn(start, end, steps, dtype=dtype)
        # float32 logspace: torch counts in float32, we in float64 (closer to the exact values)
        same = torch.equal if dtype != torch.float32 or fn is torch.linspace else (
            lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=0))
        actual = fn(start, end, steps, dtype=dtype, device="jax").cpu()
        assert same(actual, expected), (start, end, steps)
        if fn is torch.linspace:
            jitted = torch2jax.jit(lambda s, e: fn(s, e, steps, dtype=dtype, device="jax"))
            actual = jitted(torch.tensor(start, device="jax"), torch.tensor(end, device="jax")).cpu()
            assert same(actual, expected), (start, end, steps)


def test_float_linspace_rounds_each_value_once_like_torch_cpu():
    # torch CPU: the step in the output type, each value one fused multiply-add from an end
    # (eagerly XLA fused some and not others: float64 values an ulp off at small sizes)
    for dtype in (torch.float32, torch.float64):
        for start, end, steps in [(-1, 1, 7), (-1, 1, 11), (-3.7, 2.2, 16), (0.1, 7.3, 13), (-1, 1, 1000)]:
            expected = torch.linspace(start, end, steps, dtype=dtype)
            assert torch.equal(torch.linspace(start, end, steps, dtype=dtype, device="jax").cpu(), expected)


_OUT_CASES = {
    "zeros": lambda d, o: torch.zeros(2, 3, out=o),
    "full": lambda d, o: torch.full((3,), 2.7, out=o),
    "eye": lambda d, o: torch.eye(3, out=o),
    "linspace": lambda d, o: torch.linspace(0, 10, 4, out=o),
    "logspace": lambda d, o: torch.logspace(0, 2, 3, out=o),
    "arange": lambda d, o: torch.arange(0, 5, 1.5, out=o),
    "arange_small_step": lambda d, o: torch.arange(0, 8, 0.5, out=o),
    "cumsum": lambda d, o: torch.cumsum(torch.tensor([1.5, 2.5, -0.7], device=d), 0, out=o),
    "cumprod": lambda d, o: torch.cumprod(torch.tensor([1.5, 2.5, -0.7], device=d), 0, out=o),
    "sum": lambda d, o: torch.sum(torch.tensor([1.5, 2.5, -0.7], device=d), 0, out=o),
    "mean": lambda d, o: torch.mean(torch.tensor([1.5, 2.5, -0.7], device=d), 0, out=o),
    "mean_of_ints": lambda d, o: torch.mean(torch.tensor([1, 0, 3], device=d), 0, out=o),
    "bernoulli": lambda d, o: torch.bernoulli(torch.ones(3, device=d), out=o),
    "kron": lambda d, o: torch.kron(torch.tensor([[1.0, 2.0]], device=d), torch.tensor([[1.0], [10.0]], device=d), out=o),
    "matrix_rank": lambda d, o: torch.linalg.matrix_rank(torch.eye(4, device=d)[None].repeat(2, 1, 1), out=o),
}


@pytest.mark.parametrize("name", sorted(_OUT_CASES))
def test_out_argument_dtypes_as_torch(name):
    # factories and sum/cumsum/mean compute in out's dtype, bernoulli writes any dtype, the
    # rest cast (or refuse) when writing; an empty out is resized, a full one written
    def outcome(device, dtype, empty):
        out = torch.empty(0 if empty else 3, dtype=dtype, device=device)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = _OUT_CASES[name](device, out)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            # (torch2jax's errors subclass the builtin one torch raises)
            return next(c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"), str(e)
        assert result is out
        return out.cpu()

    for dtype in (torch.int64, torch.int32, torch.bool, torch.float64, torch.float16):
        for empty in (True, False):
            expected, actual = outcome("cpu", dtype, empty), outcome("jax", dtype, empty)
            if isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor):
                torch.testing.assert_close(actual, expected, msg=f"{dtype} empty={empty}")
            else:
                assert type(actual) is type(expected) and (
                    not isinstance(expected, tuple) or actual[1] == expected[1]), (dtype, empty, actual, expected)


_HALF_SCALAR_OPS = {"add": torch.add, "sub": torch.sub, "rsub": torch.rsub, "mul": torch.mul, "div": torch.div,
                    "pow": torch.pow, "fmod": torch.fmod, "remainder": torch.remainder, "atan2": torch.atan2,
                    "hypot": torch.hypot, "floor_divide": torch.floor_divide, "xlogy": torch.xlogy,
                    "xlog1py": torch.special.xlog1py}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(_HALF_SCALAR_OPS))
def test_half_precision_ops_with_scalar_operands_round_as_torch(name, dtype):
    # a number or 0-dim operand is converted to the half dtype before the float32 computation,
    # except a second operand of mul / div, which torch's kernels read in float32
    fn = _HALF_SCALAR_OPS[name]
    x = (torch.rand(500, generator=torch.Generator().manual_seed(0)) * 8 + 0.01).to(dtype)
    for s in (0.1234, 3.7):
        pairs = [(x, torch.tensor(s)), (torch.tensor(s), x)]
        if name not in ("atan2", "hypot"):  # (no Python-number overloads)
            pairs.append((x, s))
        for a, b in pairs:
            to_jax = [v.to("jax") if isinstance(v, torch.Tensor) else v for v in (a, b)]
            assert torch.equal(fn(*to_jax).cpu(), fn(a, b)), (s, type(a), type(b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_add_and_sub_round_alpha_as_torch(dtype):
    # alpha is converted to the half dtype too (a few elements may differ by one unit of the
    # last place: torch's vectorized kernel fuses the multiply-add)
    gen = torch.Generator().manual_seed(0)
    x, y = ((torch.rand(2000, generator=gen) * 8).to(dtype) for _ in range(2))
    eps = torch.finfo(dtype).eps
    for fn in (torch.add, torch.sub):
        for other in (y, 3.7):
            for alpha in (0.3, 1.37):
                expected = fn(x, other, alpha=alpha)
                actual = fn(x.to("jax"), other.to("jax") if isinstance(other, torch.Tensor) else other,
                            alpha=alpha).cpu()
                assert (actual != expected).float().mean() < 0.01
                torch.testing.assert_close(actual, expected, rtol=eps, atol=8 * eps)  # (operands up to 8)


def _both(fn):
    return fn("cpu"), fn("jax")


@pytest.mark.parametrize("write", ["setitem", "full", "fill_", "new_full", "masked_fill", "index_fill", "scatter"])
@pytest.mark.parametrize("value", [0.5, -0.2, 1j])
def test_a_fraction_written_to_bool_is_true(write, value):
    # any nonzero number is True in a bool tensor, not its truncation to an integer
    def run(d):
        x = torch.zeros(2, dtype=torch.bool, device=d)
        mask, index = torch.tensor([True, False], device=d), torch.tensor([1], device=d)
        if write == "setitem":
            x[0] = value
        elif write == "full":
            x = torch.full((2,), value, dtype=torch.bool, device=d)
        elif write == "fill_":
            x.fill_(value)
        elif write == "new_full":
            x = x.new_full((2,), value)
        elif write == "masked_fill":
            x = x.masked_fill(mask, value)
        elif write == "index_fill":
            x = x.index_fill(0, index, value)
        else:
            x = x.scatter(0, index, value)
        return x.tolist()

    if write == "index_fill" and isinstance(value, complex):
        with pytest.raises(RuntimeError, match="Converting complex Scalar to non-complex type"):
            run("jax")
        return
    cpu, jax = _both(run)
    assert jax == cpu


def test_floats_cast_to_wide_unsigned_types_as_torch():
    # uint32 goes through int64 (in range: exact; negative: wraps), uint64 takes [2**63, 2**64)
    # (a negative float past int32's range is undefined behaviour in C: torch's own answer varies)
    for values, dtype, src in (([3e9, 1.0, -1.0, 4e9], torch.uint32, torch.float32),
                               ([1.5e19, 3.0, 9.3e18, -5.0], torch.uint64, torch.float64),
                               ([70000.0, 65535.0, -1.0], torch.uint16, torch.float32)):
        cpu, jax = _both(lambda d: torch.tensor(values, dtype=src, device=d).to(dtype).tolist())
        assert jax == cpu, dtype


def test_searchsorted_follows_torchs_binary_search_through_nan():
    nan = float("nan")
    for seq, values in (([1.0, 3.0, nan], [4.0, nan, 0.0, 3.0]), ([nan, nan], [1.0, nan]),
                        ([1.0, 2.0, 2.0, 2.0, 5.0], [2.0, 2.5, 5.0, 6.0, -1.0])):
        for right in (False, True):
            cpu, jax = _both(lambda d: torch.searchsorted(torch.tensor(seq, device=d), torch.tensor(values, device=d),
                                                          right=right).tolist())
            assert jax == cpu, (seq, values, right)


def test_value_dependent_results_have_torchs_strides():
    # nonzero is column-major (each coordinate of nonzero(as_tuple=True) is contiguous); unique(dim=d)
    # lays its slices out one after another along d
    x = torch.arange(24).reshape(2, 3, 4) % 3
    cases = [lambda d: torch.nonzero(torch.ones(2, 3, device=d)), lambda d: torch.argwhere(x.to(d) > 0),
             lambda d: torch.unique(x.to(d), dim=1), lambda d: torch.unique(x.to(d), dim=2, return_counts=True)[0],
             lambda d: torch.unique_consecutive(x.to(d), dim=2)]
    for case in cases:
        cpu, jax = _both(case)
        assert jax.stride() == cpu.stride() and jax.tolist() == cpu.tolist()
    assert all(t.is_contiguous() for t in torch.nonzero(x.to("jax"), as_tuple=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lerp_keeps_a_python_weight_in_float32(dtype):
    torch.manual_seed(0)
    a, b = torch.randn(1000).to(dtype), torch.randn(1000).to(dtype)
    expected = torch.lerp(a, b, 0.1)
    assert (torch.lerp(a.to("jax"), b.to("jax"), 0.1).cpu() != expected).sum() <= 2  # (1-ulp FMA differences)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lerp_takes_a_0dim_weight_of_another_dtype_rounded_to_the_inputs(dtype):
    # torch exempts a 0-dim weight from lerp's same-dtype check and casts it to the inputs' dtype
    torch.manual_seed(0)
    a, b = torch.randn(1000).to(dtype), torch.randn(1000).to(dtype)
    for weight in (torch.tensor(0.3337, dtype=torch.float64), torch.tensor(0.7771)):
        expected = torch.lerp(a, b, weight)
        for where in ("cpu", "jax"):
            assert torch.equal(torch.lerp(a.to("jax"), b.to("jax"), weight.to(where)).cpu(), expected)
    with pytest.raises(RuntimeError, match="expected dtype .* for `weight` but got dtype double"):
        torch.lerp(a.to("jax"), b.to("jax"), torch.full((1000,), 0.5, dtype=torch.float64, device="jax"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [None, 0.0337])
def test_logit_rounds_its_ratio_to_half_precision_as_torch(dtype, eps):
    # torch's kernel computes log(x / (1 - x)) in the narrow dtype, not in float32
    p = torch.rand(500, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(torch.logit(p.to("jax"), eps).cpu(), torch.logit(p, eps))
    # and its derivative grad / (x (1 - x)), also in the narrow dtype
    grad = torch.linspace(-2, 2, 500).to(dtype)
    got = torch.ops.aten.logit_backward(grad.to("jax"), p.to("jax"), eps).cpu()
    assert torch.equal(got, torch.ops.aten.logit_backward(grad, p, eps))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_entr_of_half_precision_rounds_the_log_first_as_torch(dtype):
    # torch's kernel computes -x * log(x) in the narrow dtype: the log is rounded before the product
    x = torch.cat([torch.rand(500, generator=torch.Generator().manual_seed(0)) * 3, torch.tensor([0.0, -1.0])])
    x = x.to(dtype)
    assert torch.equal(torch.special.entr(x.to("jax")).cpu(), torch.special.entr(x))


def test_logsumexp_of_float16_rounds_each_step_as_torch():
    # torch's composite runs in float16: x - max, exp, the sum and the log each rounded (an infinite max taken as 0)
    x = ((torch.rand(2000, generator=torch.Generator().manual_seed(0)) - 0.5) * 8).half().view(20, 100)
    x[0] = float("-inf")
    for dim in (-1, 0):
        assert torch.equal(torch.logsumexp(x.to("jax"), dim).cpu(), torch.logsumexp(x, dim))

_OUT_RESIZES = {
    "zeros": lambda e, d: torch.zeros(4, out=e(2)),
    "full": lambda e, d: torch.full((4,), 2.0, out=e(2)),
    "eye": lambda e, d: torch.eye(3, out=e(2)),
    "rand": lambda e, d: torch.rand(4, out=e(2)),
    "randint": lambda e, d: torch.randint(3, (4,), out=e(2, torch.long)),
    "randperm": lambda e, d: torch.randperm(4, out=e(2, torch.long)),
    "linspace": lambda e, d: torch.linspace(0, 1, 4, out=e(2)),
    "normal": lambda e, d: torch.normal(0.0, 1.0, (4,), out=e(2)),
    "bernoulli": lambda e, d: torch.bernoulli(torch.full((4,), 0.5, device=d), out=e(2)),
    "multinomial": lambda e, d: torch.multinomial(torch.ones(4, device=d), 4, out=e(2, torch.long)),
    "arange": lambda e, d: torch.arange(4.0, out=e(2)),
    "add": lambda e, d: torch.add(torch.ones(4, device=d), 1, out=e(2)),
    "sort": lambda e, d: torch.sort(torch.ones(4, device=d), out=(e(2), e(2, torch.long))),
}


@pytest.mark.parametrize("name", sorted(_OUT_RESIZES))
def test_out_resize_warns_where_torch_does(name):
    """torch warns when resize_output grows an out= tensor with elements; its factories and
    random ops resize theirs without a word."""
    def warned(device):
        def empty(n, dtype=torch.float32):
            return torch.empty(n, dtype=dtype, device=device)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _OUT_RESIZES[name](empty, device)
        first = out[0] if isinstance(out, tuple) else out
        return sum("resized" in str(w.message) for w in caught), tuple(first.shape)

    assert warned("jax") == warned("cpu")


def test_the_same_eager_training_run_twice_gives_the_same_bits():
    # every call of an op with one signature runs one program (a lowering compiled on its first call):
    # run op by op first and compiled later, a result's last bit could differ between the two runs
    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.GELU(), torch.nn.LayerNorm(53),
                                    torch.nn.Linear(53, 7)).to("jax")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(29, 37, device="jax"), torch.randint(0, 7, (29,), device="jax")
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()] + [x.var(0).cpu()]

    first, second = train(), train()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_takes_max_and_min_for_amax_and_amin(reduce, include_self):
    x = torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.0, -2.0]])
    index = torch.tensor([[0, 1, 0], [0, 0, 1]])
    src = torch.tensor([[1.0, -3.0, 4.0], [-2.0, 5.0, 0.5]])
    expected = x.scatter_reduce(0, index, src, reduce, include_self=include_self)
    got = x.to("jax").scatter_reduce(0, index.to("jax"), src.to("jax"), reduce, include_self=include_self)
    torch.testing.assert_close(got.cpu(), expected)


@pytest.mark.parametrize("eps", [0.1, 0.7, 1.0])
def test_logit_clamps_in_torchs_order(eps):
    # with eps > 0.5 the bounds cross: torch takes eps for x < eps, else 1 - eps for x > 1 - eps
    x = torch.tensor([0.05, 0.2, 0.5, 0.9, float("nan")])
    torch.testing.assert_close(torch.logit(x.to("jax"), eps).cpu(), torch.logit(x, eps), equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.float16])
def test_copy_of_a_python_number(dtype):
    want = torch.zeros(3, dtype=dtype).copy_(2.7)
    got = torch.zeros(3, dtype=dtype, device="jax").copy_(2.7)
    assert got.dtype == want.dtype and got.tolist() == want.tolist()


def _index_with(x, index):
    y = x.clone()
    y[index] = 9.0
    z = x.clone().index_put_((index,), torch.tensor(1.0, device=index.device), accumulate=True)
    return x[index], y, z


@pytest.mark.parametrize("index", [torch.tensor([0, 2, 2]), torch.tensor([True, False, True, True, False, False])])
def test_a_cpu_tensor_indexed_with_jax_indices_is_indexed_on_the_cpu(index):
    # torch moves index tensors to the device of the tensor they index (a CUDA index on a CPU tensor works)
    x = torch.arange(6.0)
    for got, want in zip(_index_with(x, index.to("jax")), _index_with(x, index)):
        assert got.device.type == "cpu" and torch.equal(got, want)
    w = torch.arange(6.0, requires_grad=True)
    w[index.to("jax")].sum().backward()
    assert torch.equal(w.grad, torch.zeros(6).index_put_((index,), torch.tensor(1.0), accumulate=True))
    # the other way round, a CPU index on a jax tensor
    assert all(torch.equal(g.cpu(), e) for g, e in zip(_index_with(x.to("jax"), index), _index_with(x, index)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.complex64])
def test_an_alpha_of_zero_ignores_nan_matrices_where_blas_does(dtype):
    """torch's CPU addmm / addbmm (float and complex) and addmv (float) hand alpha to BLAS,
    which never reads the matrices when it is 0: their nans leave no trace. Half-precision
    kernels, baddbmm and addr compute the product and keep them."""
    nan, ones = torch.full((3, 3), float("nan"), dtype=dtype), torch.ones(3, 3, dtype=dtype)
    v = nan[0]

    def ops(n, a, v):
        return (torch.addmm(a, n, n.t(), alpha=0), torch.addmm(a, n, n, alpha=0, beta=0),
                torch.addbmm(a, n[None], n[None], alpha=0), torch.addmv(a[0], n, v, alpha=0),
                torch.baddbmm(a[None], n[None], n[None], alpha=0), torch.addr(a, v, v, alpha=0))

    for got, want in zip(ops(nan.to("jax"), ones.to("jax"), v.to("jax")), ops(nan, ones, v)):
        torch.testing.assert_close(got.cpu(), want, equal_nan=True)


def test_a_complex_tensor_divided_by_a_python_zero_is_infinite_as_torch():
    """XLA turns a division by a broadcast scalar into a multiplication by its reciprocal,
    and a complex zero's reciprocal is nan: z / 0 was nan+nanj everywhere."""
    z = torch.tensor([1 + 2j, -1 + 0j, 0j, 1j, complex(float("inf"), 0)])
    for divisor in (0, 0.0, 0j, torch.tensor(0j)):
        torch.testing.assert_close((z.to("jax") / divisor).cpu(), z / divisor, equal_nan=True)
