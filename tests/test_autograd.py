"""Eager autograd on jax-device tensors, against torch CPU gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch2jax as t2j


def _pair(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    cpu = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    jx = [c.detach().to("jax").requires_grad_() for c in cpu]
    return cpu, jx


def test_backward_matches_cpu():
    (a, b), (ja, jb) = _pair((4, 3), (3, 5))
    loss = ((a @ b).tanh() * 2).sum()
    jloss = ((ja @ jb).tanh() * 2).sum()
    loss.backward()
    jloss.backward()
    assert isinstance(ja.grad, t2j.Tensor)
    torch.testing.assert_close(ja.grad.cpu(), a.grad)
    torch.testing.assert_close(jb.grad.cpu(), b.grad)


def test_autograd_grad_and_no_grad_and_detach():
    (x,), (jx,) = _pair((5,))
    (g,) = torch.autograd.grad((x.exp() * x).sum(), x)
    (jg,) = torch.autograd.grad((jx.exp() * jx).sum(), jx)
    torch.testing.assert_close(jg.cpu(), g)
    with torch.no_grad():
        y = jx * 2
    assert not y.requires_grad
    assert not jx.detach().requires_grad


def test_grad_through_inplace_on_view():
    (x,), (jx,) = _pair((3, 4))

    def f(t):
        y = t.clone()
        y[:, 1].mul_(3)
        y.t()[0].add_(y[:, 2])
        return (y * y).sum()

    f(x).backward()
    f(jx).backward()
    torch.testing.assert_close(jx.grad.cpu(), x.grad)


def test_mlp_gradients_match_cpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    x = torch.randn(6, 8)
    y = torch.randint(0, 4, (6,))
    F.cross_entropy(model(x), y).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.to("jax")
    loss = F.cross_entropy(model(x.to("jax")), y.to("jax"))
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_optimizer_step_in_place_on_parameters():
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 2)
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(ref.state_dict())
    model.to("jax")
    x = torch.randn(8, 4)
    opts = [torch.optim.Adam(ref.parameters(), lr=0.1), torch.optim.Adam(model.parameters(), lr=0.1)]
    for _ in range(3):
        for m, opt, inp in ((ref, opts[0], x), (model, opts[1], x.to("jax"))):
            opt.zero_grad()
            m(inp).pow(2).mean().backward()
            opt.step()
    torch.testing.assert_close(model.weight.cpu(), ref.weight.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_requires_grad_flag(requires_grad):
    x = torch.ones(2, device="jax", requires_grad=requires_grad)
    assert x.requires_grad == requires_grad
    assert (x * 2).requires_grad == requires_grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4)])
def test_cross_entropy_gradient_with_every_target_ignored(reduction, shape):
    """An all-padding batch: torch's loss is nan (mean) but its gradient is zero, not nan."""

    def run(device):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
        target = torch.full((shape[0], *shape[2:]), -100).to(device)
        loss = F.cross_entropy(x, target, reduction=reduction)
        loss.sum().backward()
        return loss.detach().cpu(), x.grad.cpu()

    (loss, grad), (expected_loss, expected_grad) = run("jax"), run("cpu")
    torch.testing.assert_close(loss, expected_loss, equal_nan=True)
    assert grad.tolist() == expected_grad.tolist()
    assert not torch.signbit(grad).any()


def _raise(error):
    raise error


HOOK_ERRORS = {
    "tensor_hook": lambda dev: _hooked_tensor(dev).sum().backward(),
    "tensor_hook_autograd_grad": lambda dev: torch.autograd.grad(_hooked_tensor(dev).sum(), _LEAF[dev]),
    "module_full_backward_hook": lambda dev: _hooked_module(dev, "register_full_backward_hook"),
    "module_full_backward_pre_hook": lambda dev: _hooked_module(dev, "register_full_backward_pre_hook"),
    "post_accumulate_grad_hook": lambda dev: _post_accumulate(dev),
    "tensor_hook_given_no_gradient": lambda dev: _hook_on_unused(dev, lambda g: g * 2),
    "tensor_hook_replacing_no_gradient": lambda dev: _hook_on_unused(dev, lambda g: torch.ones(2, device=dev)),
    "saved_tensors_unpack_hook": lambda dev: _unpacking(dev),
    "checkpoint_recomputing_other_shapes": lambda dev: _recomputing_other_shapes(dev),
}
_LEAF = {}


def _hook_on_unused(dev, hook):
    """``hook`` on a part of ``x`` the loss does not use: it is given None."""
    x = torch.ones(4, device=dev, requires_grad=True)
    used, unused = x.split(2)
    unused.register_hook(hook)
    used.sum().backward()


def _unpacking(dev):
    x = torch.ones(2, device=dev, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: _raise(ValueError("cannot unpack"))):
        y = x.exp().sum()
    y.backward()


def _recomputing_other_shapes(dev):
    calls = []

    def f(x):
        calls.append(1)
        return (x[: len(calls)] * x[: len(calls)]).sum()  # the recomputation sees other shapes

    x = torch.ones(4, device=dev, requires_grad=True)
    torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False).backward()


def _hooked_tensor(dev):
    x = _LEAF[dev] = torch.ones(3, device=dev, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: _raise(ValueError("bad gradient")))
    return y


def _hooked_module(dev, register):
    m = torch.nn.Linear(3, 2).to(dev)
    getattr(m, register)(lambda *args: _raise(KeyError("hook")))
    m(torch.ones(4, 3, device=dev, requires_grad=True)).sum().backward()


def _post_accumulate(dev):
    p = torch.nn.Parameter(torch.ones(3, device=dev))
    p.register_post_accumulate_grad_hook(lambda t: _raise(RuntimeError("after accumulation")))
    (p * 2).sum().backward()


@pytest.mark.parametrize("name", sorted(HOOK_ERRORS))
def test_backward_hook_error_is_raised_like_torch(name):
    # an exception in a Python hook on a jax-device graph used to abort the process
    with pytest.raises(Exception) as expected:
        HOOK_ERRORS[name]("cpu")
    with pytest.raises(type(expected.value)) as caught:
        HOOK_ERRORS[name]("jax")
    assert str(caught.value).replace("device(type='jax', index=0)", "device(type='cpu')") == str(expected.value)


def _returning(kind, value):
    """A backward pass whose ``kind`` of hook returns ``value(gradient)``."""

    def run(dev):
        w = torch.ones(3, device=dev, requires_grad=True)
        m = torch.nn.Linear(3, 3).to(dev)
        if kind == "tensor":
            w.register_hook(value)
        elif kind == "post_accumulate_grad":
            w.register_post_accumulate_grad_hook(value)
        elif kind == "module_full_backward":
            m.register_full_backward_hook(lambda mod, grad_input, grad_output: value(grad_input))
        else:
            m.register_full_backward_pre_hook(lambda mod, grad_output: value(grad_output))
        m(w * 2).sum().backward()

    return run


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate_grad", "module_full_backward", "module_full_backward_pre"])
@pytest.mark.parametrize("value", [lambda g: (g, g), lambda g: 1,
                                   lambda g: g.double() if isinstance(g, torch.Tensor) else g,
                                   lambda g: torch.ones(5)], ids=["tuple", "int", "double", "other_size"])
def test_hook_returning_the_wrong_thing_raises_like_torch(kind, value):
    """torch's checks of what a hook returns (the engine's, the module hooks') raise inside the
    backward pass, where for a jax-device graph the process used to abort."""
    run = _returning(kind, value)
    try:
        run("cpu")
    except Exception as error:  # noqa: BLE001 - whatever torch raises, the jax device must raise too
        with pytest.raises(type(error)) as caught:
            run("jax")
        assert str(caught.value).replace("torch.jax.", "torch.") == str(error)
    else:
        run("jax")


def test_hook_deciding_on_gradient_value_under_jit_runs_eagerly():
    def clip(g):
        return g / g.abs().max() if g.abs().max() > 1 else g

    torch.manual_seed(0)
    cpu = torch.nn.Linear(3, 3)
    jx = torch.nn.Linear(3, 3).to("jax")
    jx.load_state_dict(cpu.state_dict())
    for m in (cpu, jx):
        m.weight.register_hook(clip)

    def make_step(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            loss = model(x).pow(2).sum()
            loss.backward()
            opt.step()
            return loss

        return step

    jitted, eager = t2j.jit(make_step(jx)), make_step(cpu)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)) * 3
    with pytest.warns(UserWarning, match="runs eagerly"):
        for _ in range(3):
            torch.testing.assert_close(jitted(x.to("jax")).cpu(), eager(x).detach())
    torch.testing.assert_close(jx.weight.detach().cpu(), cpu.weight.detach())


_SECOND_ORDER = {
    # a reduced loss's double backward passes its backward an input-shaped gradient
    "rmse": lambda x, t: F.mse_loss(x, t).sqrt(),
    "smooth_l1.exp": lambda x, t: F.smooth_l1_loss(x, t).exp(),
    "huber_sum.square": lambda x, t: F.huber_loss(x, t, reduction="sum") ** 2,
    "bce.square": lambda x, t: F.binary_cross_entropy(x.sigmoid(), t) ** 2,
    # prelu's kernel gives the weight's gradient per element
    "prelu": lambda x, t: F.prelu(x, t[0, :1] * 0 + 0.2).square().sum(),
}


@pytest.mark.parametrize("name", sorted(_SECOND_ORDER))
def test_double_backward_matches_cpu(name):
    f = _SECOND_ORDER[name]
    target = torch.rand(4, 6, generator=torch.Generator().manual_seed(3))
    results = []
    for device in ("cpu", "jax"):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
        (g,) = torch.autograd.grad(f(x, target.to(device)), x, create_graph=True)
        results.append(torch.autograd.grad(g.square().sum(), x)[0].cpu())
    torch.testing.assert_close(results[1], results[0])


def test_forward_mode_det_of_a_non_contiguous_matrix():
    # torch factors A^T of a contiguous real A only; its det/slogdet derivative formulas read
    # the factors accordingly
    a = torch.tensor([[2.0, 1.0, 0.0, 9.0], [3.0, 3.0, 1.0, 9.0], [0.0, 5.0, 4.0, 9.0]])
    t = torch.zeros(3, 4)
    t[0, 1] = 1
    fns = (lambda m: torch.linalg.det(m[:, :3]), lambda m: torch.linalg.slogdet(m[:, :3])[1],
           lambda m: torch.linalg.det(m[:, :3].contiguous()), lambda m: torch.linalg.det(m[:, :3].mT))
    for f in fns:
        want = torch.func.jvp(f, (a,), (t,))[1]
        got = torch.func.jvp(f, (a.to("jax"),), (t.to("jax"),))[1]
        torch.testing.assert_close(got.cpu(), want)
