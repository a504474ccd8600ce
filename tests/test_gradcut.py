"""Where torch's autograd graph is cut (no_grad, detach, .data, writes with grad mode
off, custom Functions' own backward), JAX's differentiation of the traced program is cut the same way: the outputs
of `t2j.jit` and `t2j.compile` going into ``backward()``, `functionalize` under
`jax.grad`, `call_torch`. torch CPU's gradients are the oracle."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as checkpoint

import torch2jax as t2j
from torch2jax.gradcut import straight_through


class Cuts(nn.Module):
    """A forward with every kind of cut: a straight-through estimator, a scale computed
    under no_grad, a detached view, a view made under no_grad and a buffer written under it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("center", torch.zeros(4))

    def forward(self, x):
        h = self.lin(x)
        q = torch.round(h * 2) / 2
        ste = h + (q - h).detach()
        with torch.no_grad():
            scale = h.abs().max() + 1
            first = h[:, :2]
            self.center.mul_(0.5).add_(h.mean(0), alpha=0.5)
        target = h.detach()[:, 1:3] * 2
        return (ste * h / scale).sum() + (first * h[:, 2:]).sum() + ((h[:, :2] - target) ** 2).sum() \
            + (h * self.center).sum()


class Clipped(nn.Module):
    """WGAN-style weight clipping inside the forward: torch's gradient reaches the weight
    as if the clipping had not happened (the write is not recorded), at the clipped value."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.2, 0.2)
        self.lin.bias.detach().clamp_(-0.1, 0.1)
        return (self.lin(x) ** 2).sum()


def _run(module_cls, device, mode):
    torch.manual_seed(0)
    model = module_cls()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    model = model.to(device)
    call = {"eager": model, "jit": t2j.jit(model), "compile": t2j.compile(model)}[mode]
    call(x).backward()
    return [x.grad] + [p.grad for p in model.parameters()] + [t.detach() for t in model.state_dict().values()]


@pytest.mark.parametrize("mode", ["eager", "jit", "compile"])
@pytest.mark.parametrize("module_cls", [Cuts, Clipped])
def test_torch_facing_gradients_follow_the_cuts(module_cls, mode):
    want = _run(module_cls, "cpu", "eager")
    got = _run(module_cls, "jax", mode)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)


def _functional_grads(module_cls, jit):
    torch.manual_seed(0)
    model = module_cls().to("jax")
    fn, state = t2j.functionalize(model)
    x = jnp.asarray(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).numpy())
    grad = jax.grad(lambda s, x: fn(s, x), argnums=(0, 1))
    return (jax.jit(grad) if jit else grad)(state, x)


@pytest.mark.parametrize("jit", [False, True])
def test_jax_grad_of_functionalized_module_follows_the_cuts(jit):
    want = _run(Cuts, "cpu", "eager")
    g_state, g_x = _functional_grads(Cuts, jit)
    np.testing.assert_allclose(g_x, want[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_state["params"]["lin.weight"], want[1].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_state["params"]["lin.bias"], want[2].numpy(), rtol=1e-5, atol=1e-5)


def test_writes_with_grad_off_keep_the_old_value_s_gradient_under_jax_grad():
    def f(w):
        y = w * 3
        y.detach().mul_(2)  # y's values double; its place in the graph stays
        with torch.no_grad():
            w.clamp_(max=1.5)
        return (y * y).sum() + (w * w).sum()

    w0 = torch.tensor([0.5, 1.0, 2.0, -3.0])
    w_cpu = w0.clone().requires_grad_()
    f(w_cpu * 1).backward()  # through a non-leaf, which torch lets no_grad write
    got = jax.grad(t2j.jax_view(f))(jnp.asarray(w0.numpy()))
    np.testing.assert_allclose(got, w_cpu.grad.numpy(), rtol=1e-6)


def test_caller_s_no_grad_does_not_reach_jax_differentiated_torch_code():
    f = t2j.jax_view(lambda x: (x.sin() ** 2).sum())
    with torch.no_grad():
        got = jax.grad(f)(jnp.arange(3.0))
    np.testing.assert_allclose(got, np.sin(2 * np.arange(3.0)), rtol=1e-6)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_custom_function_forward_is_differentiated_not_cut():
    got = jax.grad(t2j.jax_view(lambda x: _Square.apply(x).sum()))(jnp.arange(3.0))
    np.testing.assert_allclose(got, [0.0, 2.0, 4.0])


class _CubeWithOwnRule(torch.autograd.Function):
    """x ** 3 whose gradient rule says x ** 2: a second derivative through it is the rule's (2x),
    not the forward's (6x)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x ** 2 * g


def test_second_derivative_through_a_custom_function_under_jax():
    f = lambda t: _CubeWithOwnRule.apply(t).sum()  # noqa: E731
    x = np.array([1.0, 2.0, -0.5])
    expected = torch.autograd.functional.hessian(f, torch.tensor(x))
    got = jax.hessian(lambda a: t2j.call_torch(f, a))(jnp.asarray(x))
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-6)
    got = jax.jit(jax.grad(lambda a: jax.grad(lambda b: t2j.call_torch(f, b))(a).sum()))(jnp.asarray(x))
    np.testing.assert_allclose(got, expected.sum(1).numpy(), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_gradient_penalty_through_a_custom_function(jit):
    def step(w, x):
        g, = torch.autograd.grad(_CubeWithOwnRule.apply(w * x).sum(), w, create_graph=True)
        penalty = (g ** 2).sum()
        penalty.backward()
        return penalty.detach()

    x = torch.tensor([0.5, 1.5, -1.0])
    w, wj = torch.tensor([1.0, 2.0, 3.0], requires_grad=True), torch.tensor([1.0, 2.0, 3.0], device="jax",
                                                                             requires_grad=True)
    expected = step(w, x)
    got = (t2j.jit(step) if jit else step)(wj, x.to("jax"))
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close(wj.grad.cpu(), w.grad)


class _ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class _RoundStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Adversarial(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return _RoundStraightThrough.apply(self.lin(_ReverseGradient.apply(x, 2.0)) * 3).pow(2).sum()


@pytest.mark.parametrize("mode", ["jax.grad", "jit(jax.grad)", "t2j.jit", "t2j.compile"])
def test_custom_function_backward_is_used_where_jax_differentiates(mode):
    """A gradient reversal layer and a straight-through rounding: JAX's derivative of
    their forwards is not torch's gradient; theirs is."""
    torch.manual_seed(0)
    ref = _Adversarial()
    model = copy.deepcopy(ref).to("jax")
    x = torch.tensor([[0.2, 1.7, -2.0], [0.4, -0.3, 0.9]])
    xc = x.clone().requires_grad_()
    ref(xc).backward()
    if mode.startswith("t2j"):
        xj = x.to("jax").requires_grad_()
        (t2j.jit(model) if mode == "t2j.jit" else t2j.compile(model))(xj).backward()
        got_x, got_w = xj.grad.cpu(), model.lin.weight.grad.cpu()
    else:
        fn, state = t2j.functionalize(model)
        grad = jax.grad(fn, argnums=(0, 1))
        g_state, g_x = (jax.jit(grad) if mode.startswith("jit") else grad)(state, jnp.asarray(x.numpy()))
        got_x, got_w = torch.from_numpy(np.asarray(g_x)), torch.from_numpy(np.asarray(g_state["params"]["lin.weight"]))
    torch.testing.assert_close(got_x, xc.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_w, ref.lin.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wrap", ["checkpoint", "scan", "checkpoint in scan"])
@pytest.mark.parametrize("where", ["the function", "outside"])
def test_custom_function_inside_a_jax_transform_under_t2j_jit(wrap, where):
    """A Function in a `t2j.checkpoint` block or a `t2j.scan` body of a jitted step (Bloom's
    fused GELU under use_scan_layers): its own backward gives the gradients; the tensors its
    reruns make, which JAX's jaxpr keeps, are not state the step made."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    x = torch.tensor([[0.2, 1.7, -2.0], [0.4, -0.3, 0.9]])

    def loss_of(layer, v):
        if wrap == "checkpoint":
            block = t2j.checkpoint if isinstance(v, t2j.Tensor) else lambda f: f
            return block(lambda u: _RoundStraightThrough.apply(layer(_ReverseGradient.apply(u, 2.0)) * 3))(v).sum()
        block = lambda c: c + 0.5 * _RoundStraightThrough.apply(layer(c))
        body = lambda c, _: (block(c), None)
        if isinstance(v, t2j.Tensor):
            if wrap == "checkpoint in scan":
                body = lambda c, _: (t2j.checkpoint(block)(c), None)
            return t2j.scan(body, v, None, length=3)[0].sum()
        for _ in range(3):
            v = body(v, None)[0]
        return v.sum()

    loss_of(lin, x).backward()
    jlin = copy.deepcopy(lin).to("jax")
    for p in jlin.parameters():
        p.grad = None
    if where == "the function":
        def step(v):
            loss = loss_of(jlin, v)
            loss.backward()
            return loss
        t2j.jit(step)(x.to("jax"))
    else:
        t2j.jit(lambda v: loss_of(jlin, v))(x.to("jax")).backward()
    torch.testing.assert_close(jlin.weight.grad.cpu(), lin.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(jlin.bias.grad.cpu(), lin.bias.grad, rtol=1e-5, atol=1e-5)


class _ClosedOver(torch.autograd.Function):
    """Reads a parameter it is not given (no gradient reaches it through the Function, as
    in torch), counts its calls in a buffer, returns an input as it is and a second,
    non-differentiable output."""

    scale = None
    calls = None

    @staticmethod
    def forward(ctx, x, y):
        _ClosedOver.calls.add_(1)
        ctx.save_for_backward(x)
        idx = torch.argsort(x, dim=-1)
        ctx.mark_non_differentiable(idx)
        return x * _ClosedOver.scale, y, idx

    @staticmethod
    def backward(ctx, g, gy, gidx):
        (x,) = ctx.saved_tensors
        return g * _ClosedOver.scale * 3 + x, gy * -1


class _UsesClosedOver(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        _ClosedOver.scale, _ClosedOver.calls = self.lin.weight[0], self.calls
        a, b, idx = _ClosedOver.apply(self.lin(x), x * 2)
        return (a * self.lin.weight[1]).sum() + (b * b).sum() + idx.float().sum()


@pytest.mark.parametrize("mode", ["jax.grad", "t2j.jit", "t2j.compile"])
def test_custom_function_closing_over_a_parameter(mode):
    torch.manual_seed(0)
    ref = _UsesClosedOver()
    model = copy.deepcopy(ref).to("jax")
    x = torch.tensor([[0.2, 1.7, -2.0], [0.4, -0.3, 0.9]])
    xc = x.clone().requires_grad_()
    ref(xc).backward()
    if mode.startswith("t2j"):
        xj = x.to("jax").requires_grad_()
        (t2j.jit(model) if mode == "t2j.jit" else t2j.compile(model))(xj).backward()
        got_x, got_w = xj.grad.cpu(), model.lin.weight.grad.cpu()
    else:
        fn, state = t2j.functionalize(model)
        g_state, g_x = jax.grad(fn, argnums=(0, 1))(state, jnp.asarray(x.numpy()))
        got_x, got_w = torch.from_numpy(np.asarray(g_x)), torch.from_numpy(np.asarray(g_state["params"]["lin.weight"]))
    torch.testing.assert_close(got_x, xc.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_w, ref.lin.weight.grad, rtol=1e-5, atol=1e-5)
    if mode != "jax.grad":  # functionalize returns the buffer's new value instead of writing it
        assert model.calls.item() == ref.calls.item() == 1


class _Dropout(torch.autograd.Function):
    """A dropout written as a Function: draws its mask in the forward, saves it for the
    backward, and appends to a global list on every forward."""

    runs: list = []

    @staticmethod
    def forward(ctx, x):
        _Dropout.runs.append(1)
        mask = (torch.rand_like(x) > 0.5).to(x.dtype)
        ctx.save_for_backward(mask)
        return x * mask * 2

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask * 2


@pytest.mark.parametrize("where", ["backward inside", "backward outside"])
def test_custom_function_drawing_random_numbers_under_jit(where):
    """The backward sees the mask the outputs were made with; a step whose backward runs
    inside the program runs the forward (and its side effects) once."""
    x = torch.randn(256, device="jax", requires_grad=True)
    _Dropout.runs.clear()
    if where == "backward inside":
        def step(x):
            y = _Dropout.apply(x)
            (y * y).sum().backward()
            return y

        y = t2j.jit(step)(x)
        assert len(_Dropout.runs) == 1
    else:
        y = t2j.jit(_Dropout.apply)(x)
        (y * y).sum().backward()
    mask = (y != 0).float().cpu()
    assert 0 < mask.sum() < 256
    torch.testing.assert_close(x.grad.cpu(), 2 * y.detach().cpu() * mask * 2)


class _ThroughData(nn.Module):
    """Weight clipping, an EMA and a target made through ``.data``: autograd sees none of them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("ema", torch.zeros(3, 3))

    def forward(self, x):
        self.lin.weight.data.clamp_(-0.3, 0.3)
        self.ema.data.mul_(0.9).add_(0.1 * self.lin.weight.data)
        h = self.lin(x)
        target = h.data * 2
        return ((h - target) ** 2).sum() + (h * self.lin.weight.data.sum()).sum()


@pytest.mark.parametrize("mode", ["jax.grad", "t2j.jit", "t2j.compile"])
def test_data_is_a_cut(mode):
    torch.manual_seed(0)
    ref = _ThroughData()
    model = copy.deepcopy(ref).to("jax")
    x = torch.tensor([[0.2, 1.7, -2.0], [0.4, -0.3, 0.9]])
    xc = x.clone().requires_grad_()
    ref(xc).backward()
    if mode.startswith("t2j"):
        xj = x.to("jax").requires_grad_()
        (t2j.jit(model) if mode == "t2j.jit" else t2j.compile(model))(xj).backward()
        got_x, got_w = xj.grad.cpu(), model.lin.weight.grad.cpu()
        torch.testing.assert_close(model.lin.weight.detach().cpu(), ref.lin.weight.detach())
        torch.testing.assert_close(model.ema.cpu(), ref.ema)
    else:
        fn, state = t2j.functionalize(model)
        g_state, g_x = jax.grad(fn, argnums=(0, 1))(state, jnp.asarray(x.numpy()))
        got_x, got_w = torch.from_numpy(np.asarray(g_x)), torch.from_numpy(np.asarray(g_state["params"]["lin.weight"]))
    torch.testing.assert_close(got_x, xc.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_w, ref.lin.weight.grad, rtol=1e-5, atol=1e-5)


class _RebindsData(nn.Module):
    """A forward that replaces a parameter's value through ``.data`` (a rescaling step)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        self.lin.weight.data = (self.lin.weight * 0.5).data
        return (self.lin(x) ** 2).sum()


@pytest.mark.parametrize("mode", ["jax.grad", "t2j.jit", "t2j.compile"])
def test_data_rebound_in_a_forward_is_a_leaf_for_the_gradient(mode):
    """``p.data = v.data``: the parameter holds the new value, and its gradient is taken at the
    new value, as for any leaf (torch's autograd never sees the rebinding)."""
    torch.manual_seed(0)
    ref = _RebindsData()
    model = copy.deepcopy(ref).to("jax")
    x = torch.tensor([[0.2, 1.7, -2.0], [0.4, -0.3, 0.9]])
    ref(x).backward()
    if mode.startswith("t2j"):
        (t2j.jit(model) if mode == "t2j.jit" else t2j.compile(model))(x.to("jax")).backward()
        got_w = model.lin.weight.grad.cpu()
        torch.testing.assert_close(model.lin.weight.detach().cpu(), ref.lin.weight.detach())
    else:
        fn, state = t2j.functionalize(model)
        g_state = jax.grad(fn)(state, jnp.asarray(x.numpy()))
        got_w = torch.from_numpy(np.asarray(g_state["params"]["lin.weight"]))
    torch.testing.assert_close(got_w, ref.lin.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpoint_under_jax_grad():
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).to("jax")
    fn, state = t2j.functionalize(lin)

    def loss(s, x):
        return t2j.jax_view(lambda x: checkpoint.checkpoint(lambda h: torch.tanh(h), x, use_reentrant=True).sum())(
            fn(s, x))

    x = jnp.ones((2, 3))
    got = jax.grad(loss)(state, x)
    want = jax.grad(lambda s, x: jnp.tanh(fn(s, x)).sum())(state, x)
    np.testing.assert_allclose(got["params"]["weight"], want["params"]["weight"], rtol=1e-6)


def test_straight_through_value_is_exact_and_gradient_is_the_old_one():
    old = jnp.array([1.0, 2.0, 3.0, 4.0])
    new = jnp.array([-0.0, jnp.inf, jnp.nan, 1e30])
    out = jax.jit(straight_through)(old, new)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(new))
    np.testing.assert_array_equal(out, new)
    g = jax.grad(lambda o: (straight_through(o, o ** 3) * 2).sum())(old)
    np.testing.assert_allclose(g, [2.0] * 4)
    batched = jax.vmap(jax.grad(lambda o: (straight_through(o, o ** 2) * o).sum()))(jnp.stack([old, old]))
    np.testing.assert_allclose(batched, np.stack([old ** 2 + old] * 2))
    np.testing.assert_allclose(jax.vmap(straight_through, in_axes=(None, 0))(old, jnp.stack([new, new]))[:, 3], 1e30)


def test_eager_detach_and_no_grad_are_unchanged():
    x = torch.randn(3, device="jax", requires_grad=True)
    d = x.detach()
    assert d._t2j_view == () and d._t2j_storage is x._t2j_storage
    with torch.no_grad():
        y = x * 2
    assert not y.requires_grad
    d.add_(1)  # writes through, as in torch
    torch.testing.assert_close(x.detach().cpu(), (y / 2 + 1).cpu())
    assert copy.copy(d)._t2j_storage is x._t2j_storage


@pytest.mark.parametrize("how", ["call_torch", "jit_forward"])
def test_item_is_a_constant_where_jax_differentiates(how):
    # torch's t.item() is a Python number: no gradient flows through it (nor through max() of one)
    def f(t):
        return (t * t.sum().item()).sum() + t.sum() * max(t.max().item(), 0.5)

    t = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    f(t).backward()
    if how == "call_torch":
        got = np.asarray(jax.grad(lambda a: t2j.call_torch(f, a))(jnp.array([1.0, 2.0, 3.0])))
    else:
        tj = torch.tensor([1.0, 2.0, 3.0], device="jax", requires_grad=True)
        t2j.jit(f)(tj).backward()
        got = tj.grad.cpu().numpy()
    np.testing.assert_allclose(got, t.grad.numpy())


def _hooked(x):
    y = x * 2
    y.register_hook(lambda g: -g)  # (a gradient reversal)
    z = y.sin()
    removed = z.register_hook(lambda g: g * 100)
    removed.remove()
    z.register_hook(lambda g: None)  # (returns nothing: the gradient passes as it is)
    return (z ** 2).sum() + y.sum()


class _Clipped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        h = self.lin(x)
        h.register_hook(lambda g: g.clamp(-0.5, 0.5))
        return (h ** 3).sum()


@pytest.mark.parametrize("jit", [False, True])
def test_gradient_hooks_run_where_jax_differentiates(jit):
    x = torch.linspace(-1, 1, 3, requires_grad=True)
    _hooked(x).backward()
    grad = jax.grad(lambda a: t2j.call_torch(_hooked, a))
    np.testing.assert_allclose((jax.jit(grad) if jit else grad)(jnp.linspace(-1, 1, 3)), x.grad.numpy(), rtol=1e-5)

    torch.manual_seed(0)
    ref = _Clipped()
    fn, state = t2j.functionalize(copy.deepcopy(ref).to("jax"))
    xs = torch.randn(4, 3)
    ref(xs).backward()
    grad = jax.grad(fn)
    got = (jax.jit(grad) if jit else grad)(state, jnp.asarray(xs.numpy()))
    np.testing.assert_allclose(got["params"]["lin.weight"], ref.lin.weight.grad.numpy(), rtol=1e-5)
    np.testing.assert_allclose(got["params"]["lin.bias"], ref.lin.bias.grad.numpy(), rtol=1e-5)
