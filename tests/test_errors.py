"""Bad input and missing lowerings: clear errors naming the op, one-time host-fallback warnings."""

from __future__ import annotations

import warnings

import jax
import pytest
import torch

import torch2jax as t2j
from torch2jax.tensor import new_tensor

_lib = torch.library.Library("t2jtest", "DEF")
_lib.define("double_it(Tensor x) -> Tensor")
_lib.impl("double_it", lambda x: x * 2, "CPU")
_lib.impl("double_it", lambda x: torch.empty_like(x), "Meta")
_lib.define("mix(Tensor a, Tensor b) -> Tensor")
_lib.impl("mix", lambda a, b: a + b, "CPU")
# A mutating op whose default its functional variant lacks (like bernoulli_.float / bernoulli.p).
_lib.define("scale_(Tensor(a!) x, float factor=3.0) -> Tensor(a!)")
_lib.define("scale(Tensor x, float factor) -> Tensor")
_lib.impl("scale_", lambda x, factor=3.0: x.mul_(factor), "CPU")
_lib.impl("scale", lambda x, factor: x * factor, "CPU")
_lib.impl("scale", lambda x, factor: torch.empty_like(x), "Meta")



@torch.library.custom_op("t2jtest::softclip", mutates_args=())
def _softclip(x: torch.Tensor, limit: float) -> torch.Tensor:
    """A custom op with a device-agnostic kernel written in torch ops."""
    return limit * torch.tanh(x / limit)


_softclip.register_autograd(
    lambda ctx, grad: (grad * (1 - torch.tanh(ctx.x / ctx.limit) ** 2), None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]) or setattr(ctx, "limit", inputs[1]),
)


@torch.library.custom_op("t2jtest::cpu_only", mutates_args=(), device_types="cpu")
def _cpu_only(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.numpy() * 3)


@torch.library.custom_op("t2jtest::cpu_cube", mutates_args=(), device_types="cpu")
def _cpu_cube(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.numpy() ** 3 + bias.numpy())


_cpu_cube.register_fake(lambda x, bias: torch.empty_like(x))
_cpu_cube.register_autograd(
    lambda ctx, grad: (grad * 3 * ctx.x ** 2, grad),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
)


@torch.library.custom_op("t2jtest::segment_sums", mutates_args=())
def _segment_sums(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """A device-agnostic kernel that reads its input's values (as transformers' grouped matmul fallback)."""
    starts = [0] + ends.tolist()[:-1]
    return torch.stack([x[a:b].sum(0) for a, b in zip(starts, ends.tolist())])


_segment_sums.register_fake(lambda x, ends: x.new_empty(ends.shape[0], *x.shape[1:]))


def test_a_custom_op_whose_kernel_reads_values_runs_on_the_host_when_traced():
    x, ends = torch.arange(12.0).view(6, 2), torch.tensor([2, 5, 6])
    expected = _segment_sums(x, ends) * 2
    xj, ej = x.to("jax"), ends.to("jax")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eagerly the kernel runs on the jax device
        torch.testing.assert_close(_segment_sums(xj, ej).cpu() * 2, expected)
    with pytest.warns(UserWarning, match=r"segment_sums.default has no JAX lowering that runs traced \(its function "
                                         r"needs its inputs' values"):
        jitted = t2j.jit(lambda a, e: _segment_sums(a, e) * 2)
        torch.testing.assert_close(jitted(xj, ej).cpu(), expected)
    assert jitted.stats["eager_calls"] == 0  # one program, the op a host callback inside it
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, e: _segment_sums(a, e) * 2, backend="torch2jax")
    torch.testing.assert_close(compiled(xj, ej).cpu(), expected)


def test_host_fallback_is_differentiated_by_torch_on_the_host():
    # a traced host fallback differentiated by JAX (a jitted forward whose backward runs
    # outside it, jax.grad of a jitted function) runs the op's torch backward on the CPU
    x, bias = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.0, 1.0, 2.0])
    cot = torch.tensor([1.0, 2.0, 3.0])
    xc, bc = x.clone().requires_grad_(), bias.clone().requires_grad_()
    (_cpu_cube(xc, bc) * cot).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        xj, bj = x.to("jax").requires_grad_(), bias.to("jax").requires_grad_()
        (t2j.jit(_cpu_cube)(xj, bj) * cot.to("jax")).sum().backward()
        torch.testing.assert_close(xj.grad.cpu(), xc.grad)
        torch.testing.assert_close(bj.grad.cpu(), bc.grad)

        def f(a):
            return (torch.ops.t2jtest.cpu_cube(new_tensor(a), new_tensor(bias.numpy())).jax() * cot.numpy()).sum()

        assert jax.grad(jax.jit(f))(x.numpy()).tolist() == xc.grad.tolist()


def test_custom_op_kernel_runs_on_the_jax_device():
    # a torch.library.custom_op's device-agnostic kernel runs as a decomposition (no host
    # round trip, and under t2j.jit); one registered for the CPU only falls back to the host
    x = torch.linspace(-5, 5, 7)
    expected = _softclip(x.clone().requires_grad_(), 2.0)
    expected.sum().backward()
    with t2j.env(fallback="error"):
        xj = x.to("jax").requires_grad_()
        out = torch.ops.t2jtest.softclip(xj, 2.0)
        out.sum().backward()
        jitted = t2j.jit(lambda a: torch.ops.t2jtest.softclip(a, 2.0) * 2)(x.to("jax"))
    torch.testing.assert_close(out.detach().cpu(), expected.detach())
    torch.testing.assert_close(jitted.cpu(), expected.detach() * 2)
    assert t2j.path_of(torch.ops.t2jtest.softclip.default) == "decomposition"
    with pytest.warns(UserWarning, match="cpu_only.*runs on the host"):
        assert _cpu_only(torch.arange(3.0, device="jax")).cpu().tolist() == [0.0, 3.0, 6.0]
    assert t2j.path_of(torch.ops.t2jtest.cpu_only.default) == "fallback"


def test_unlowered_op_falls_back_to_host_with_one_warning():
    x = torch.arange(4.0, device="jax")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = torch.ops.t2jtest.double_it(x)
        z = torch.ops.t2jtest.double_it(y)
    assert isinstance(z, t2j.Tensor)
    assert z.cpu().tolist() == [0.0, 4.0, 8.0, 12.0]
    msgs = [str(m.message) for m in w if "t2jtest.double_it" in str(m.message)]
    assert len(msgs) <= 1  # once per process: an earlier test may have triggered it
    assert t2j.path_of(torch.ops.t2jtest.double_it.default) == "fallback"


def test_host_fallback_works_under_jit():
    def f(a):
        return torch.ops.t2jtest.double_it(new_tensor(a)).jax() + 1

    with jax.enable_x64(True):
        out = jax.jit(f)(jax.numpy.arange(3.0))
    assert out.tolist() == [1.0, 3.0, 5.0]


def test_fallback_error_mode_names_the_op():
    with t2j.env(fallback="error"):
        with pytest.raises(t2j.OpError, match="t2jtest.double_it"):
            torch.ops.t2jtest.double_it(torch.ones(2, device="jax"))


def test_shape_mismatch_gives_torch_message():
    with pytest.raises(RuntimeError, match=r"(size of tensor a \(3\) must match|broadcast a dimension of length 4)"):
        torch.ones(3, device="jax") + torch.ones(4, device="jax")


def test_matmul_shape_mismatch_gives_torch_message():
    with pytest.raises(RuntimeError, match="(cannot be multiplied|same reduction dim)"):
        torch.ones(2, 3, device="jax") @ torch.ones(4, 5, device="jax")


def test_wrong_dtype_gives_torch_message():
    with pytest.raises(RuntimeError, match="(?i)(long|same dtype)"):
        torch.nn.functional.linear(torch.ones(2, 3, device="jax"), torch.ones(4, 3, dtype=torch.long, device="jax"))


def test_view_errors_like_torch():
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        torch.ones(2, 3, device="jax").view(4)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        torch.ones(2, 3, device="jax").t().view(6)


def test_index_out_of_range_raises():
    x = torch.arange(5, device="jax")
    with pytest.raises(IndexError):
        x[10]
    with pytest.raises((IndexError, RuntimeError), match="out of"):
        x[torch.tensor([1, 7], device="jax")]


def test_item_inside_jit_is_a_clear_error():
    def f(a):
        return new_tensor(a).sum().item()

    with pytest.raises(Exception, match="(?i)concrete|trac"):
        jax.jit(f)(jax.numpy.ones(3))


# -- devices: CPU tensors beside jax tensors ------------------------------------


def test_cpu_tensor_with_jax_tensor_names_the_op_and_devices():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, device="jax")
    with pytest.raises(RuntimeError, match=r"aten\.mul\.Tensor.*same device.*jax:0 and cpu.*shape \[3\]"):
        a * b
    with pytest.raises(RuntimeError, match=r"aten\.add\.Tensor.*shape \[2, 3\]"):
        b + torch.ones(2, 3)


def test_cpu_tensor_inside_a_decomposition_names_the_called_op():
    from torch2jax.dispatch import DeviceMismatchError, path_of

    assert path_of(torch.ops.aten.dist.default) == "decomposition"
    with pytest.raises(DeviceMismatchError, match=r"aten\.dist\.default"):
        torch.dist(torch.ones(3, device="jax"), torch.zeros(3))


def test_cpu_tensor_into_a_host_fallback_op_is_refused():
    from torch2jax.dispatch import DeviceMismatchError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.ops.t2jtest.mix(torch.ones(2, device="jax"), torch.ones(2, device="jax")).cpu().tolist() == [2, 2]
    with pytest.raises(DeviceMismatchError, match=r"t2jtest\.mix\.default"):
        torch.ops.t2jtest.mix(torch.ones(2, device="jax"), torch.ones(2))


def test_cpu_tensor_in_place_into_a_jax_tensor_is_refused():
    x = torch.zeros(3, device="jax")
    with pytest.raises(RuntimeError, match=r"aten\.add_\.Tensor.*same device"):
        x.add_(torch.ones(3))
    assert x.cpu().tolist() == [0.0, 0.0, 0.0]


def test_zero_dim_cpu_tensors_mix_with_jax_tensors_and_get_gradients():
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor([1.0, 2.0, 3.0], device="jax", requires_grad=True)
    ga, gb = torch.autograd.grad((a * b).sum(), [a, b])
    assert ga.device.type == "cpu" and ga.item() == 6.0
    assert gb.cpu().tolist() == [2.0, 2.0, 2.0]


def test_cpu_tensors_where_torch_takes_them_on_another_device():
    x = torch.arange(12.0).reshape(4, 3)
    xj = x.to("jax")
    idx = torch.tensor([2, 0])
    torch.testing.assert_close(xj[idx].cpu(), x[idx])
    torch.testing.assert_close(xj[torch.tensor([True, False, True, False])].cpu(), x[[0, 2]])
    y, yj = x.clone(), xj.clone()
    y[idx] = torch.tensor(7.0)
    yj[idx] = torch.tensor(7.0)
    torch.testing.assert_close(yj.cpu(), y)
    parts = torch.tensor_split(xj, torch.tensor([1, 3]))
    assert [list(p.shape) for p in parts] == [[1, 3], [2, 3], [1, 3]]
    z = torch.zeros(4, 3, device="jax")
    z.copy_(x)
    torch.testing.assert_close(z.cpu(), x)


def test_cpu_values_for_index_put_are_refused_like_torch():
    xj = torch.zeros(4, device="jax")
    with pytest.raises(RuntimeError, match="same device"):
        xj.index_put_((torch.tensor([0, 1]),), torch.tensor([1.0, 2.0]))


# -- in-place ops rerouted to their functional variant: omitted defaults ------------


def test_bernoulli_in_place_takes_its_default_p():
    torch.manual_seed(0)
    x = torch.zeros(20000, device="jax")
    x.bernoulli_()
    assert set(x.unique().cpu().tolist()) == {0.0, 1.0}
    assert abs(x.mean().item() - 0.5) < 0.02
    out = torch.empty(20000, device="jax")
    torch.ops.aten.bernoulli.float_out(x, out=out)
    assert abs(out.mean().item() - 0.5) < 0.02
    x.bernoulli_(0.1)
    assert abs(x.mean().item() - 0.1) < 0.02


def test_in_place_op_default_reaches_its_functional_variant():
    from torch2jax.dispatch import path_of

    x = torch.arange(4.0)
    xj = x.to("jax")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ops.t2jtest.scale_(xj)
        torch.ops.t2jtest.scale_(x)
        torch.testing.assert_close(xj.cpu(), x)
        torch.ops.t2jtest.scale_(xj, 0.5)
        torch.ops.t2jtest.scale_(x, 0.5)
    torch.testing.assert_close(xj.cpu(), x)
    assert path_of(torch.ops.t2jtest.scale_.default) == "functional"


def test_an_error_in_a_backward_kernel_is_raised_by_backward():
    """An error raised by a jax-device kernel that the autograd engine calls comes out of
    backward() / autograd.grad with its message (torch would abort the process on it), and
    the next backward pass runs normally."""
    from torch2jax import dispatch
    from torch2jax.ops import registry

    op = torch.ops.aten.scatter_add.default  # gather's backward

    def failing(*args, **kwargs):
        raise ValueError("scatter_add kernel failed")

    def forget(func):
        dispatch._HANDLERS.pop(func, None)
        dispatch._PATHS.pop(func, None)
        dispatch._BY_ID.pop(id(func), None)

    original = registry.LOWERINGS[op]
    registry.LOWERINGS[op] = failing
    forget(op)
    try:
        x = torch.randn(5, device="jax", requires_grad=True)
        index = torch.tensor([0, 3, 3], device="jax")
        for run in (lambda out: out.sum().backward(), lambda out: torch.autograd.grad(out.sum(), x)):
            with pytest.raises(RuntimeError, match="scatter_add kernel failed") as info:
                run(torch.gather(x, 0, index))
            assert any("aten.scatter_add" in note for note in info.value.__notes__)
    finally:
        registry.LOWERINGS[op] = original
        forget(op)
    (grad,) = torch.autograd.grad(torch.gather(x, 0, index).sum(), x)
    assert grad.cpu().tolist() == [1.0, 0.0, 0.0, 2.0, 0.0]


def test_backward_runs_on_the_calling_thread():
    """The engine would run jax-device nodes on a device worker thread, which does not see
    the caller's thread-local state (t2j.env scopes among it)."""
    import threading

    seen = []
    x = torch.randn(3, device="jax", requires_grad=True)
    x.register_hook(lambda g: seen.append(threading.get_ident()))
    (x * 2).sum().backward()
    assert seen == [threading.get_ident()]


@pytest.mark.parametrize("name, write", [
    ("mask_setitem", lambda x, d: x.__setitem__(x > 5, torch.arange(5.0, device=d))),
    ("index_setitem", lambda x, d: x.__setitem__(torch.tensor([0, 1], device=d), torch.ones(3, 4, device=d))),
    ("index_add_count", lambda x, d: x.index_add_(1, torch.tensor([0, 1], device=d), torch.ones(2, 3, device=d))),
    ("index_add_shape", lambda x, d: x.index_add_(0, torch.tensor([0], device=d), torch.ones(1, 3, device=d))),
    ("index_copy_dims", lambda x, d: x.index_copy_(0, torch.tensor([0], device=d), torch.ones(4, device=d))),
    ("index_copy_slice", lambda x, d: x.index_copy_(1, torch.tensor([0, 1], device=d), torch.ones(2, 3, device=d))),
    ("index_copy_count", lambda x, d: x.index_copy_(1, torch.tensor([0, 1], device=d), torch.ones(3, 3, device=d))),
])
def test_indexed_writes_of_a_wrong_shape_raise_torchs_error(name, write):
    # before: a wrapped JAX broadcasting error, or (index_add_ / index_copy_) a silently reshaped source
    raised = {}
    for device in ("cpu", "jax"):
        x = torch.arange(12.0, device=device).reshape(3, 4)
        with pytest.raises((RuntimeError, IndexError)) as info:
            write(x, device)
        raised[device] = (isinstance(info.value, IndexError), str(info.value))
        assert x.tolist() == torch.arange(12.0).reshape(3, 4).tolist()
    assert raised["jax"] == raised["cpu"]


@pytest.mark.parametrize("name, call", [
    ("sign_complex", lambda d: torch.sign(torch.ones(2, dtype=torch.complex64, device=d))),
    ("hypot_complex", lambda d: torch.hypot(*[torch.ones(2, dtype=torch.complex64, device=d)] * 2)),
    ("logcumsumexp_long", lambda d: torch.ones(2, dtype=torch.long, device=d).logcumsumexp(0)),
    ("round_decimals_long", lambda d: torch.ones(2, dtype=torch.long, device=d).round(decimals=1)),
])
def test_unsupported_dtypes_raise_torchs_not_implemented_error(name, call):
    raised = {}
    for device in ("cpu", "jax"):
        with pytest.raises(NotImplementedError) as info:
            call(device)
        raised[device] = str(info.value)
    assert raised["jax"] == raised["cpu"]


@pytest.mark.parametrize("make", [
    lambda x: torch.nested.nested_tensor([x, x[:2]]),
    lambda x: torch.nested.as_nested_tensor([x, x[:2]]),
    lambda x: torch.nested.nested_tensor([x.cpu(), x[:2].cpu()], device="jax"),
    lambda x: torch.nested.narrow(x, 1, 0, 2),
    lambda x: torch._nested_tensor_from_tensor_list([x, x[:2]]),
])
def test_a_strided_nested_tensor_on_the_jax_device_is_one_clear_error(make):
    # torch built one whose every later op (print, unbind, .cpu()) failed in the dispatcher
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's prototype warning)
        with pytest.raises(NotImplementedError, match="nested tensors of the strided layout .* layout=torch.jagged"):
            make(torch.ones(3, 4, device="jax"))
