"""Eager ops that run as cached jax.jit calls (torch2jax/dispatch.py, `_Compiled`)
give torch's results: the cache key must separate everything that changes the
result (Python scalar types and values, dtypes, 0-dim tensors, the default dtype,
view chains read inside the compiled call)."""

from __future__ import annotations

import math

import pytest
import torch

import torch2jax as t2j
from torch2jax import dispatch
from torch2jax.ops.registry import LOWERINGS

# Enough calls to pass the compile threshold, each checked.
REPEAT = 4


@pytest.fixture(autouse=True)
def compile_at_once(monkeypatch):
    monkeypatch.setattr(dispatch, "_COMPILE_AFTER", 0)


def _check(fn, *inputs):
    expected = fn(*inputs)
    jax_inputs = [a.to("jax") if isinstance(a, torch.Tensor) else a for a in inputs]
    for _ in range(REPEAT):
        actual = fn(*jax_inputs)
        assert actual.dtype == expected.dtype
        torch.testing.assert_close(actual.cpu(), expected, equal_nan=True)


SCALARS = [1, 1.0, True, False, 0.5, -0.0, math.nan, math.inf, 2**40, -3, 1 + 2j]
DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_python_scalars_are_keyed_by_type_and_value(dtype):
    x = torch.tensor([0, 1, 2]).to(dtype)
    xj = x.to("jax")
    # Interleaved so that a key that confuses 1, 1.0 and True (equal and of equal
    # hash in Python) or -0.0 and 0.0 would serve one's program for another.
    for _ in range(REPEAT):
        for s in SCALARS:
            for op in (torch.add, torch.mul):
                try:
                    expected = op(x, s)
                except RuntimeError:
                    with pytest.raises(RuntimeError):
                        op(xj, s)
                    continue
                if expected.dtype == torch.complex32:  # no JAX dtype (tests/test_semantics.py)
                    continue
                actual = op(xj, s)
                assert actual.dtype == expected.dtype, (op, s)
                torch.testing.assert_close(actual.cpu(), expected, equal_nan=True, msg=f"{op} {s!r}")


def test_signed_zero_scalar():
    x = torch.tensor([0.0, 1.0])
    xj = x.to("jax")
    for _ in range(REPEAT):
        for s in (0.0, -0.0):
            assert torch.equal(torch.signbit(torch.mul(xj, s)).cpu(), torch.signbit(torch.mul(x, s)))


@pytest.mark.parametrize("zero_dtype", [torch.int64, torch.float64, torch.float16, torch.bool])
def test_zero_dim_tensors(zero_dtype):
    a = torch.tensor([1, 2, 3], dtype=torch.float32)
    for z in (torch.tensor(3).to(zero_dtype), torch.tensor(0).to(zero_dtype)):
        _check(torch.add, a, z)
        _check(torch.mul, z, a.to(torch.int32))
        # a 0-dim CPU tensor mixes with jax tensors as a scalar does
        expected = torch.add(a, z)
        for _ in range(REPEAT):
            actual = torch.add(a.to("jax"), z)
            assert actual.dtype == expected.dtype
            torch.testing.assert_close(actual.cpu(), expected)


def test_dtype_changes_at_same_shape():
    for dtype in DTYPES:
        a = torch.tensor([[1, 0], [2, 3]]).to(dtype)
        _check(torch.add, a, a)
        _check(torch.neg, a) if dtype != torch.bool else _check(torch.logical_not, a)
        if dtype.is_floating_point:
            _check(torch.matmul, a, a)


def test_default_dtype_is_part_of_the_key():
    a = torch.tensor([1, 2, 3])
    aj = a.to("jax")
    for default in (torch.float32, torch.float64, torch.float32):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            for _ in range(REPEAT):
                assert (aj + 1.5).dtype == default
                assert (aj / 2).dtype == default
        finally:
            torch.set_default_dtype(previous)


def test_errors_after_compiling():
    a, b = torch.ones(2, 3, device="jax"), torch.ones(3, 2, device="jax")
    for _ in range(REPEAT):
        a @ b
    with pytest.raises(RuntimeError):
        a @ a
    for _ in range(REPEAT):
        torch.testing.assert_close((a @ b).cpu(), torch.full((2, 2), 3.0))


def test_value_checks_still_run():
    """Lowerings that check values (index bounds, integer division by zero) raise torch's error
    from their compiled calls (the checks are outputs of the program)."""
    x = torch.arange(4, device="jax")
    for _ in range(REPEAT):
        x[torch.tensor([1, 2], device="jax")]
    with pytest.raises(IndexError):
        x[torch.tensor([1, 7], device="jax")]
    for _ in range(REPEAT):
        torch.floor_divide(x, torch.tensor([1, 1, 1, 1], device="jax"))
    with pytest.raises(RuntimeError):
        torch.floor_divide(x, torch.tensor([1, 0, 1, 1], device="jax"))


def test_matmul_precision_is_part_of_the_key():
    a = torch.randn(16, 16)
    aj = a.to("jax")
    previous = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high", "highest"):
            torch.set_float32_matmul_precision(precision)
            for _ in range(REPEAT):
                torch.testing.assert_close((aj @ aj).cpu(), a @ a)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_lazy_views_read_inside_compiled_calls():
    x = torch.arange(24.0).reshape(4, 6)
    xj = x.to("jax")
    for _ in range(REPEAT):
        torch.testing.assert_close((xj.t() * 2).cpu(), x.t() * 2)
        torch.testing.assert_close((xj[1:3].t() + xj[:2].t()).cpu(), x[1:3].t() + x[:2].t())
        torch.testing.assert_close((xj.view(6, 4).t()[1:] - 1).cpu(), x.view(6, 4).t()[1:] - 1)
        torch.testing.assert_close(torch.addmm(xj[0, :4], xj, xj.t()).cpu(), torch.addmm(x[0, :4], x, x.t()))


def test_lazy_view_sees_later_writes():
    x = torch.arange(6.0).reshape(2, 3)
    xj = x.to("jax")
    for _ in range(REPEAT):
        v, vj = x.t(), xj.t()
        x.add_(1)
        xj.add_(1)
        torch.testing.assert_close((vj * 1).cpu(), v * 1)
        vj.mul_(2)  # written through the view into the base
        v.mul_(2)
        torch.testing.assert_close(xj.cpu(), x)
        torch.testing.assert_close(vj.cpu(), v)


def test_mlp_forward_and_backward():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(8, 8)
    expected = mlp(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()]
    mlp_j = mlp.to("jax")
    for p in mlp_j.parameters():
        p.grad = None
    xj = x.to("jax")
    for _ in range(REPEAT):
        for p in mlp_j.parameters():
            p.grad = None
        out = mlp_j(xj)
        torch.testing.assert_close(out.cpu(), expected)
        out.sum().backward()
        for p, g in zip(mlp_j.parameters(), grads):
            torch.testing.assert_close(p.grad.cpu(), g)


def test_jit_after_eager_compiles():
    def f(a, b):
        return torch.relu(a @ b.t() + 1)

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    aj, bj = a.to("jax"), b.to("jax")
    for _ in range(REPEAT):
        torch.testing.assert_close(f(aj, bj).cpu(), f(a, b))
    torch.testing.assert_close(t2j.jit(f)(aj, bj).cpu(), f(a, b))


def _compiled_of(handler):
    """The _Compiled call inside a lowering handler (possibly behind the layout wrapper)."""
    for cell in handler.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, dispatch._Compiled):
            return value
        if callable(value) and getattr(value, "__closure__", None):
            found = _compiled_of(value)
            if found is not None:
                return found
    return None


@pytest.mark.parametrize("op", ["sin.default", "add.Tensor", "mul.Tensor", "clamp.default", "fill.Scalar",
                                "full.default", "pow.Tensor_Scalar", "lerp.Scalar", "addcmul.default"])
def test_lowerings_checking_python_numbers_still_compile(op):
    # their scalar check branches on tracers only for a number t2j.jit lifted, never in a compiled call
    func = eval(f"torch.ops.aten.{op}")
    assert dispatch._jittable(func, LOWERINGS[func])


def test_compiles_only_from_the_third_call(monkeypatch):
    monkeypatch.setattr(dispatch, "_COMPILE_AFTER", 2)
    a = torch.ones(3, 5, device="jax")
    handler = dispatch._HANDLERS.get(torch.ops.aten.mm.default) or dispatch._resolve(torch.ops.aten.mm.default)
    compiled = _compiled_of(handler)
    compiled.signatures.clear()
    kinds = []
    for _ in range(4):
        torch.mm(a, a.t())
        (entry,) = compiled.signatures.values()
        kinds.append(type(entry) is int)
    assert kinds == [True, True, False, False]


@pytest.fixture
def backend_compiles():
    """A list that gets an entry for every XLA compilation while the test runs."""
    from jax._src import monitoring

    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    monitoring.register_event_duration_secs_listener(listener)
    yield seen
    monitoring.unregister_event_duration_listener(listener)


VIEWS_AT = {
    "select": lambda x, i: x[i],
    "select_negative": lambda x, i: x[-i - 1],
    "select_dim1": lambda x, i: x[:, i],
    "slice": lambda x, i: x[i:i + 3],
    "slice_open": lambda x, i: x[i:],
    "slice_step": lambda x, i: x[i:i + 5:2],
    "slice_clamped": lambda x, i: x[i - 3:i + 100],
    "narrow_dim1": lambda x, i: x.narrow(1, i, 2),
    "nested": lambda x, i: x[:, 1:][i][i % 3:],
}


@pytest.mark.parametrize("view", VIEWS_AT)
def test_views_at_integer_positions_read_and_write_as_torch(view):
    x = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    xj = x.to("jax")
    for i in range(5):
        torch.testing.assert_close((VIEWS_AT[view](xj, i) * 2 + 1).cpu(), VIEWS_AT[view](x, i) * 2 + 1)
        torch.testing.assert_close(VIEWS_AT[view](xj, i).cpu(), VIEWS_AT[view](x, i))
        VIEWS_AT[view](x, i).mul_(-1).add_(i)
        VIEWS_AT[view](xj, i).mul_(-1).add_(i)
        torch.testing.assert_close(xj.cpu(), x)


def test_a_loop_over_minibatches_compiles_its_ops_once(backend_compiles):
    # where a slice or row starts is an input of the programs reading it: one program for every minibatch
    x, w = torch.randn(64, 4).to("jax"), torch.randn(4, 3).to("jax")

    def batch(i):
        return (x[i:i + 8] @ w).relu().sum() + x[i].sum()

    batch(0).item()
    before = len(backend_compiles)
    got = [batch(i).item() for i in range(1, 40)]
    assert len(backend_compiles) == before
    xc, wc = x.cpu(), w.cpu()
    assert got == pytest.approx([((xc[i:i + 8] @ wc).relu().sum() + xc[i].sum()).item() for i in range(1, 40)],
                                rel=1e-5)


def test_changing_float_arguments_compile_once(backend_compiles):
    # a float an op takes as a parameter (leaky_relu's slope, layer_norm's eps) is an input of its program
    # once a second value comes: a slope that changes every call does not compile the op every call
    x = torch.randn(8, 16)
    xj = x.to("jax")
    ops = {
        "leaky_relu": lambda t, s: torch.nn.functional.leaky_relu(t, s),
        "elu": lambda t, s: torch.nn.functional.elu(t, alpha=s),
        "layer_norm": lambda t, s: torch.nn.functional.layer_norm(t, (16,), eps=s),
        "hardtanh": lambda t, s: torch.nn.functional.hardtanh(t, -s, s),
    }
    for fn in ops.values():
        for s in (0.015, 0.02):  # (not 0.01: torch leaves leaky_relu's default slope out of the call)
            fn(xj, s).cpu()
    before = len(backend_compiles)
    for s in (0.03, 0.07, 0.11, 0.13, 0.17):
        for name, fn in ops.items():
            torch.testing.assert_close(fn(xj, s).cpu(), fn(x, s), msg=name)
    assert len(backend_compiles) == before


def test_batch_norm_cumulative_average_compiles_once(backend_compiles):
    # BatchNorm(momentum=None) passes 1 / num_batches_tracked, a new float every step
    def run(device, steps, compiles=None):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8, momentum=None), torch.nn.Linear(8, 3))
        m = m.to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x, y = torch.randn(5, 6).to(device), torch.randint(0, 3, (5,)).to(device)
        losses = []
        for step in range(steps):
            if step == 4 and compiles is not None:
                before = len(compiles)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if compiles is not None:
            assert len(compiles) == before
        return losses, {k: v.cpu() for k, v in m.state_dict().items()}

    losses, state = run("jax", 10, backend_compiles)
    expected_losses, expected_state = run("cpu", 10)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for k in state:
        torch.testing.assert_close(state[k], expected_state[k], msg=k)


def test_float_arguments_a_lowering_reads_stay_static(monkeypatch, backend_compiles):
    # huber_loss checks its delta in Python: its floats stay static (a program each), and after
    # _MAX_FLOAT_VALUES of them its other values run op by op; its checks still run
    monkeypatch.setattr(dispatch, "_MAX_FLOAT_VALUES", 4)
    x, t = torch.randn(6, 5), torch.randn(6, 5)
    xj, tj = x.to("jax"), t.to("jax")
    values = [0.1 * i + 0.05 for i in range(10)]
    for i, d in enumerate(values):
        if i == 6:  # (op by op from the fifth value: its primitives compiled at the fifth)
            before = len(backend_compiles)
        torch.testing.assert_close(torch.nn.functional.huber_loss(xj, tj, delta=d).cpu(),
                                   torch.nn.functional.huber_loss(x, t, delta=d))
    assert len(backend_compiles) == before
    with pytest.raises(RuntimeError, match="delta"):
        torch.nn.functional.huber_loss(xj, tj, delta=-0.5)


@pytest.mark.parametrize("special", [0.0, -0.0, 1.0, 2.0, 0.5])
def test_float_inputs_at_values_xla_simplifies(special):
    # values XLA's simplifier treats as special constants keep programs of their own
    x = torch.tensor([-2.0, -0.0, 0.0, 1.5, math.inf, -math.inf, math.nan])
    xj = x.to("jax")
    fns = [lambda t, s: torch.nn.functional.leaky_relu(t, s), lambda t, s: torch.nn.functional.elu(t, alpha=s)]
    for i, fn in enumerate(fns):
        for s in (0.015, 0.02, special, 0.03):
            expected, actual = fn(x, s), fn(xj, s).cpu()
            torch.testing.assert_close(actual, expected, equal_nan=True)
            if i == 0:  # (elu of alpha -0.0 gives -0.0 * expm1(-0.0) = 0.0 at -0.0, where torch gives -0.0)
                assert torch.equal(torch.signbit(actual), torch.signbit(expected))


def test_ops_on_bool_arrays_compile_whole_and_bool_arithmetic_keeps_torchs_nans(backend_compiles):
    # where / masked_fill / logical ops on masks are one program each; a lowering converting a bool
    # to a number runs op by op (XLA would turn False * nan into 0, torch gives nan)
    x = torch.tensor([[math.nan, 1.0, -2.0], [math.inf, 0.5, math.nan]])
    mask = torch.tensor([[True, False, True], [False, False, True]])
    xj, mj = x.to("jax"), mask.to("jax")
    ops = [lambda t, m: torch.where(m, t, -t), lambda t, m: t.masked_fill(m, 7.0),
           lambda t, m: (m & ~m.flip(0)) | m.roll(1, 1), lambda t, m: torch.cummax(m.long() * 0 + m, 1)[1]]
    for op in ops:
        torch.testing.assert_close(op(xj, mj).cpu(), op(x, mask), equal_nan=True)
    before = len(backend_compiles)
    for op in ops[:3]:
        op(xj, mj).cpu()
    assert len(backend_compiles) == before  # (cached programs, not op-by-op primitives compiled again)
    for product in (lambda m, t: m * t, lambda m, t: t * m, lambda m, t: torch.mul(m, t[0]),
                    lambda m, t: m.float() * t):
        torch.testing.assert_close(product(mj, xj).cpu(), product(mask, x), equal_nan=True)
    # a new shape: one program for the op (op by op, each of the scan's primitives would compile)
    m = torch.tensor([[False, True, True, False, True]])
    before = len(backend_compiles)
    torch.testing.assert_close(torch.cummax(m.to("jax"), 1)[1].cpu(), torch.cummax(m, 1)[1])
    assert len(backend_compiles) - before <= 6  # (with the copy to the device; op by op: over 50)


def test_a_float_input_program_keeps_torch_scalar_overflow_checks():
    # after two values a signature's floats become program inputs; one that would not fit the result
    # dtype stays static, so torch's check that it fits runs (not a silent inf)
    h = torch.zeros(3, dtype=torch.float16, device="jax")
    for v in (1.5, 2.5, 3.5, 7.25):
        h.fill_(v)
        assert h[0].item() == v
        assert torch.clamp(h, max=v - 1)[0].item() == v - 1
    with pytest.raises(RuntimeError, match="cannot be converted to type c10::Half without overflow"):
        h.fill_(1e6)
    with pytest.raises(RuntimeError, match="cannot be converted to type c10::Half without overflow"):
        torch.clamp(h, max=1e6)


def test_inplace_ops_through_permuted_views_do_not_lay_out_their_results(monkeypatch):
    # the functional op's result is only written into the view: laying it out in torch's strides
    # (a transpose, then a transpose back to read it) was wasted work
    relaid = []
    laid_out = dispatch._laid_out

    def counting(t, strides):
        if isinstance(t, torch.Tensor) and strides is not None and tuple(strides) != t.stride():
            relaid.append(strides)
        return laid_out(t, strides)

    monkeypatch.setattr(dispatch, "_laid_out", counting)
    x = torch.arange(12.0).reshape(3, 4)
    jx = x.to("jax")
    for t in (x, jx):
        t.t().mul_(2)
        t.permute(1, 0).add_(t.t())
        torch.exp_(t.t()[1:])
    assert not relaid
    torch.testing.assert_close(jx.cpu(), x)
    assert (jx.t() * 2).stride() == (x.t() * 2).stride()  # an out-of-place result keeps torch's layout
    assert relaid


VALUE_CHECKING = ["gather.default", "index.Tensor", "index_put.default", "embedding.default", "nll_loss_forward.default",
                  "nll_loss_backward.default", "scatter.src", "index_select.default", "masked_fill.Tensor",
                  "floor_divide.default", "remainder.Tensor", "binary_cross_entropy.default", "take.default"]


@pytest.mark.parametrize("op", VALUE_CHECKING)
def test_lowerings_checking_values_compile(op):
    # their value checks (registry.check_values) are outputs of the compiled call, raised after it runs
    func = eval(f"torch.ops.aten.{op}")
    assert dispatch._jittable(func, LOWERINGS[func])


BAD_VALUES = {
    # name: (call, good arguments, bad arguments); each call's error is torch CPU's
    "gather": (lambda x, i: x.gather(1, i), torch.tensor([[0], [2], [1]]), torch.tensor([[0], [5], [1]])),
    "index": (lambda x, i: x[i], torch.tensor([2, 0]), torch.tensor([2, -4])),
    "index_put": (lambda x, i: x.index_put((i,), torch.ones(2, 3, device=x.device)), torch.tensor([2, 0]),
                  torch.tensor([3, 0])),
    "embedding": (lambda x, i: torch.nn.functional.embedding(i, x), torch.tensor([1, 2]), torch.tensor([1, 3])),
    "cross_entropy": (lambda x, t: torch.nn.functional.cross_entropy(x, t), torch.tensor([0, 2, 1]),
                      torch.tensor([0, 3, 1])),
    "cross_entropy_ignored": (lambda x, t: torch.nn.functional.cross_entropy(x, t, ignore_index=7),
                              torch.tensor([0, 7, 1]), torch.tensor([-2, 7, 1])),
    "scatter_add": (lambda x, i: x.scatter_add(0, i, torch.ones(1, 3, device=x.device)), torch.tensor([[2, 0, 1]]),
                    torch.tensor([[2, 0, 3]])),
    "index_select": (lambda x, i: x.index_select(1, i), torch.tensor([0, 2]), torch.tensor([0, 3])),
    "take": (lambda x, i: x.take(i), torch.tensor([0, 8]), torch.tensor([0, 9])),
    "floor_divide": (lambda x, d: torch.arange(3, device=x.device) // d, torch.tensor([1, 2, 3]),
                     torch.tensor([1, 0, 3])),
    "bce": (lambda x, t: torch.nn.functional.binary_cross_entropy(x.sigmoid(), t),
            torch.full((3, 3), 0.5), torch.full((3, 3), 1.5)),
}


def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the error is what is compared
        return e
    raise AssertionError(f"no error from {fn}")


@pytest.mark.parametrize("name", BAD_VALUES)
def test_compiled_value_checks_raise_torchs_error(name, backend_compiles):
    call, good, bad = BAD_VALUES[name]
    x = torch.randn(3, 3)
    xj = x.to("jax")
    for _ in range(REPEAT):  # (compiled at the first call: the bad call runs the same program)
        torch.testing.assert_close(call(xj, good.to("jax")).cpu(), call(x, good))
    compiles = len(backend_compiles)
    expected = _error_of(call, x, bad)
    error = _error_of(call, xj, bad.to("jax"))
    assert isinstance(error, type(expected)) and str(error) == str(expected)
    assert len(backend_compiles) == compiles  # (not run again op by op to find the error)
    torch.testing.assert_close(call(xj, good.to("jax")).cpu(), call(x, good))
    with t2j.env(check_indices=False):  # no check: no error (and no sync on the checks' outcome)
        call(xj, bad.to("jax"))


def test_value_checking_lowerings_compile_one_program_per_shape(backend_compiles):
    # a new shape (a batch of another length) compiles the lowering once, not each of its primitives
    for n in (37, 38, 39):  # (shapes no other test uses: each is new)
        x, t = torch.randn(n, 11).to("jax"), torch.randint(0, 11, (n,)).to("jax")
        x.jax().block_until_ready(), t.jax().block_until_ready()
        before = len(backend_compiles)
        loss = torch.nn.functional.nll_loss(x, t)
        assert len(backend_compiles) - before == 1
        torch.testing.assert_close(loss.cpu(), torch.nn.functional.nll_loss(x.cpu(), t.cpu()))


RANDOM_CALLS = {
    "rand": lambda: torch.rand(3, 4, device="jax"),
    "randn_float64": lambda: torch.randn(5, device="jax", dtype=torch.float64),
    "rand_bfloat16": lambda: torch.rand(6, device="jax", dtype=torch.bfloat16),
    "dropout": lambda: torch.nn.functional.dropout(torch.ones(4, 5, device="jax"), 0.3, True),
    "bernoulli": lambda: torch.bernoulli(torch.full((8,), 0.4, device="jax")),
    # (uniform_(a, b) and normal_(m, s) scale with a fused multiply-add: the last bit may differ)
    "uniform_": lambda: torch.empty(7, device="jax").uniform_(),
    "randperm": lambda: torch.randperm(9, device="jax"),
    "exponential_": lambda: torch.empty(5, device="jax").exponential_(),
}


@pytest.mark.parametrize("name", RANDOM_CALLS)
def test_random_ops_compile_and_draw_the_op_by_op_bits(name):
    # a random op's program takes the stream's key and gives it back split: the numbers, and the stream
    # after them, are those of the op run op by op (one program where each primitive ran on its own)
    func = {"rand": "rand.default", "randn_float64": "randn.default", "rand_bfloat16": "rand.default",
            "dropout": "native_dropout.default", "bernoulli": "bernoulli.default", "uniform_": "uniform.default",
            "randperm": "randperm.default", "exponential_": "exponential.default"}[name]
    func = eval(f"torch.ops.aten.{func}")
    assert dispatch._jittable(func, LOWERINGS[func])
    call = RANDOM_CALLS[name]

    def draws():
        torch.manual_seed(7)
        return [call().cpu() for _ in range(3)] + [torch.rand(4, device="jax").cpu()]

    compiled = draws()
    handler = dispatch._HANDLERS.get(func) or dispatch._resolve(func)
    program = _compiled_of(handler)
    assert program is not None and any(not isinstance(v, int) for v in program.signatures.values())
    program.enabled = False
    try:
        op_by_op = draws()
    finally:
        program.enabled = True
    for a, b in zip(compiled, op_by_op):
        assert torch.equal(a, b)
    assert not torch.equal(compiled[0], compiled[1])


def test_a_random_op_with_a_float_that_changes_stops_compiling(backend_compiles, monkeypatch):
    # each new std of normal_ is a program of its own, up to _MAX_FLOAT_VALUES of them: then op by op
    monkeypatch.setattr(dispatch, "_MAX_FLOAT_VALUES", 3)
    x = torch.empty(1000, device="jax")
    for i in range(dispatch._MAX_FLOAT_VALUES + 2):  # (the last one op by op: its primitives compile)
        x.normal_(0.0, 1.0 + i / 8)
    before = len(backend_compiles)
    for i in range(5):
        x.normal_(0.0, 10.0 + i / 8)
    assert len(backend_compiles) == before
    assert abs(x.std().item() / 10.5 - 1) < 0.15


def test_a_uint8_mask_keeps_other_index_calls_compiled():
    # its true entries' count is known only on the host: that signature runs op by op, the op's others compile
    x = torch.randn(4, 3)
    xj = x.to("jax")
    mask = torch.tensor([1, 0, 1, 1], dtype=torch.uint8)
    with pytest.warns(UserWarning, match="uint8"):
        torch.testing.assert_close(xj[mask.to("jax")].cpu(), x[mask])
    handler = dispatch._HANDLERS.get(torch.ops.aten.index.Tensor)
    assert _compiled_of(handler).enabled
    torch.testing.assert_close(xj[torch.tensor([2, 0]).to("jax")].cpu(), x[torch.tensor([2, 0])])
