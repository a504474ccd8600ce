"""Outputs of `t2j.jit` functions carry an autograd graph: a jitted forward, then
``loss.backward()`` and ``opt.step()`` outside it, as after ``torch.compile``.
torch CPU is the oracle for values and gradients."""

from __future__ import annotations

import copy

import jax
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2jax as t2j
from torch2jax.tensor import new_tensor


def _close(a, b, tol=1e-5):
    if b is None:  # torch gives no gradient to a tensor no output depends on
        assert a is None
        return
    torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=tol, atol=tol)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))


def test_jitted_forward_trains_like_torch_cpu():
    ref = _mlp()
    model = copy.deepcopy(ref).to("jax")
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, model)]
    forward = t2j.jit(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        losses = []
        for m, opt, dev in ((ref, opts[0], "cpu"), (forward, opts[1], "jax")):
            opt.zero_grad()
            loss = F.cross_entropy(m(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            losses.append(loss)
        _close(losses[1], losses[0])
    for p, q in zip(ref.parameters(), model.parameters()):
        _close(q, p)
        _close(q.grad, p.grad)
    assert forward.stats["traces"] == 1


def test_gradients_reach_inputs_closures_and_views_of_leaves():
    torch.manual_seed(0)
    w_cpu = torch.randn(4, 5, requires_grad=True)
    x_cpu = torch.randn(3, 2, 4, requires_grad=True)
    w = w_cpu.detach().to("jax").requires_grad_()
    x = x_cpu.detach().to("jax").requires_grad_()

    def f(h):
        return torch.sin(h @ w_now) * 2, (h.sum(-1) > 0)

    w_now = w_cpu
    out_cpu, mask_cpu = f(x_cpu[:, 1])
    (out_cpu * out_cpu).sum().backward()
    w_now = w
    out, mask = t2j.jit(f)(x[:, 1])
    assert out.requires_grad and not mask.requires_grad
    (out * out).sum().backward()
    _close(out, out_cpu)
    assert torch.equal(mask.cpu(), mask_cpu)
    _close(w.grad, w_cpu.grad)
    _close(x.grad, x_cpu.grad)


def test_two_calls_and_a_non_leaf_input_in_one_graph():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    a_cpu = torch.randn(2, 4, requires_grad=True)
    lin_jax = copy.deepcopy(lin).to("jax")
    a = a_cpu.detach().to("jax").requires_grad_()
    f = t2j.jit(lambda h: torch.relu(lin_jax(h)))
    loss_cpu = torch.relu(lin(torch.relu(lin(a_cpu * 3)))).pow(2).mean()
    loss = f(f(a * 3)).pow(2).mean()
    loss_cpu.backward()
    loss.backward()
    _close(loss, loss_cpu)
    _close(a.grad, a_cpu.grad)
    for p, q in zip(lin.parameters(), lin_jax.parameters()):
        _close(q.grad, p.grad)


def test_batchnorm_stats_update_once_per_call():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    model = copy.deepcopy(ref).to("jax")
    forward = t2j.jit(model)
    x = torch.randn(2, 3, 6, 6)
    for _ in range(2):
        ref(x).sum().backward()
        forward(x.to("jax")).sum().backward()
    _close(model[1].running_mean, ref[1].running_mean)
    _close(model[1].running_var, ref[1].running_var)
    assert int(model[1].num_batches_tracked) == 2
    for p, q in zip(ref.parameters(), model.parameters()):
        _close(q.grad, p.grad, tol=1e-4)


def test_backward_replays_the_forward_dropout_mask():
    x = torch.ones(64, 64, device="jax", requires_grad=True)
    f = t2j.jit(lambda h: F.dropout(h, p=0.5, training=True))
    out = f(x)
    out.sum().backward()
    assert torch.equal(x.grad.cpu(), (out != 0).cpu().float() * 2)
    assert 0.3 < float((out != 0).float().mean()) < 0.7


def test_gradient_penalty_inside_differentiated_outside():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    model = copy.deepcopy(ref).to("jax")

    def penalty(net, x):
        x = x.requires_grad_()
        (g,) = torch.autograd.grad(net(x).sum(), x, create_graph=True)
        return (g.norm(dim=1) - 1).pow(2).mean()

    x = torch.randn(5, 3)
    penalty(ref, x.clone()).backward()
    t2j.jit(penalty)(model, x.to("jax")).backward()
    for p, q in zip(ref.parameters(), model.parameters()):
        _close(q.grad, p.grad)


def test_complex_gradients_follow_torch_convention():
    z_cpu = torch.randn(5, dtype=torch.complex64, requires_grad=True)
    z = z_cpu.detach().to("jax").requires_grad_()

    def f(v):
        return (v * v.conj() * 1j + v.exp()).abs().sum()

    f(z_cpu).backward()
    t2j.jit(f)(z).backward()
    _close(z.grad, z_cpu.grad)


def test_train_step_outputs_keep_a_spent_graph():
    """As torch's ``loss`` after ``loss.backward()``: it requires grad, and a second backward is refused."""
    model = _mlp().to("jax")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @t2j.jit
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(2):  # the trace, then the cached program
        loss = step(torch.randn(4, 6), torch.randint(0, 3, (4,)))
        assert loss.requires_grad and loss.grad_fn is not None and not loss.is_leaf
        with pytest.raises(RuntimeError, match="second time"):
            loss.backward()


def test_create_graph_backward_gives_each_call_its_own_grad():
    """``backward(create_graph=True)`` inside: the ``.grad`` it sets requires grad, and the one a call
    returns is that call's tensor, the argument's ``.grad`` itself (each call used to return one object
    holding the last call's values). Differentiating it outside is refused, as for any spent graph."""

    def f(w, x):
        (w * x).pow(3).sum().backward(create_graph=True)
        return w.grad

    jitted = t2j.jit(f)
    w_cpu = torch.randn(3, requires_grad=True)
    w = w_cpu.detach().to("jax").requires_grad_()
    grads = []
    for _ in range(3):
        x = torch.randn(3)
        w_cpu.grad = w.grad = None
        expected = f(w_cpu, x)
        got = jitted(w, x.to("jax"))
        assert got is w.grad and got.requires_grad
        grads.append((got, expected.detach().clone()))
    for got, expected in grads:
        _close(got.detach(), expected)
    with pytest.raises(RuntimeError, match="second time"):
        grads[-1][0].pow(2).sum().backward()


def test_no_grad_call_has_no_graph():
    model = _mlp().to("jax")
    forward = t2j.jit(model)
    with torch.no_grad():
        out = forward(torch.randn(2, 6, device="jax"))
    assert not out.requires_grad


def test_leaf_view_of_a_tensor_outside_the_graph_gets_its_gradient():
    base = torch.randn(4, 4, device="jax")
    view = base[0].requires_grad_()  # a leaf that requires grad and shares the storage of `base`
    (t2j.jit(lambda h: h * h)(view)).sum().backward()
    _close(view.grad, 2 * view.detach())


def test_gradients_reach_a_cpu_argument():
    x_cpu = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, device="jax", requires_grad=True)
    out = t2j.jit(lambda x: (x @ w).tanh())(x_cpu)
    out.sum().backward()
    x_ref = x_cpu.detach().clone().requires_grad_()
    (x_ref @ w.detach().cpu()).tanh().sum().backward()
    assert x_cpu.grad is not None and x_cpu.grad.device.type == "cpu"
    _close(x_cpu.grad, x_ref.grad)


def test_third_derivative_through_a_jitted_call():
    # each backward under create_graph is a call_jax of the previous one's VJP: any order works
    x_cpu = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = x_cpu.detach().to("jax").requires_grad_()
    fn = t2j.jit(lambda v: (v.sin() * v).sum())
    for f, v in ((lambda v: (v.sin() * v).sum(), x_cpu), (fn, x)):
        (g1,) = torch.autograd.grad(f(v), v, create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), v, create_graph=True)
        (g2 * g1).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad, rtol=1e-12, atol=1e-12)


GRADIENT_PENALTY_FORWARDS = {
    "jit": lambda m: t2j.jit(lambda x: m(x)),
    "compile": lambda m: t2j.compile(m),
    "call_jax": lambda m: (lambda x: t2j.call_jax(jax.numpy.tanh, m(x))),
    "checkpoint": lambda m: t2j.checkpoint(m),
}


@pytest.mark.parametrize("name", sorted(GRADIENT_PENALTY_FORWARDS))
def test_gradient_penalty_through_a_jax_computed_backward(name):
    # the penalty's gradient reaches the weights through the first backward, which ran in JAX:
    # under create_graph that backward is itself a differentiable JAX call (torch.compile raises)
    torch.manual_seed(0)
    m_cpu = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    m = copy.deepcopy(m_cpu).to("jax")
    ref = (lambda x: m_cpu(x).tanh()) if name == "call_jax" else m_cpu  # the same function in torch
    x_cpu = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    x = x_cpu.detach().to("jax").requires_grad_()
    for f, v in ((ref, x_cpu), (GRADIENT_PENALTY_FORWARDS[name](m), x)):
        y = f(v)
        (g,) = torch.autograd.grad(y.sum(), v, create_graph=True)
        (y.mean() + (g.norm(dim=1) - 1).pow(2).sum()).backward()
    # (call_jax's tanh runs in float32: JAX's default configuration)
    rtol, atol = (1e-6, 1e-7) if name == "call_jax" else (1e-10, 1e-12)
    for p_cpu, p in zip([x_cpu, *m_cpu.parameters()], [x, *m.parameters()]):
        torch.testing.assert_close(p.grad.cpu(), p_cpu.grad, rtol=rtol, atol=atol)


def test_float64_outputs_one_unused_get_float64_gradients():
    x_cpu = torch.randn(4, dtype=torch.float64, requires_grad=True)
    x = x_cpu.detach().to("jax").requires_grad_()
    a, _ = t2j.jit(lambda v: (v.exp(), v * 3))(x)  # the second output gets no cotangent
    a.sum().backward()
    assert x.grad.dtype == torch.float64
    torch.testing.assert_close(x.grad.cpu(), x_cpu.detach().exp(), rtol=1e-12, atol=1e-12)


def test_a_create_graph_backward_inside_the_function_keeps_the_outputs_graph():
    # torch.func.grad runs its backward with create_graph=True and retain_graph=False: the
    # per-sample gradients it gives are differentiable, so a loss on them trains the model
    m = _mlp()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))

    def fn(x):
        return torch.func.vmap(torch.func.grad(lambda r: m(r).sum()))(x).square().sum()

    fn(x).backward()
    want = [p.grad for p in m.parameters()]
    m.zero_grad()
    m.to("jax")
    out = t2j.jit(fn)(x.to("jax"))
    assert out.requires_grad
    out.backward()
    for p, w in zip(m.parameters(), want):
        _close(p.grad, w)


def test_gradients_reach_a_view_argument_itself():
    # the view is the autograd input, not its base: autograd.grad with respect to it, and
    # torch.autograd.functional's hessian (which passes x.view_as(x)), see its gradient
    def fn(x):
        return (x.sin() * x).sum()

    jitted = t2j.jit(fn)
    got, want = [], []
    for device, f, out in (("cpu", fn, want), ("jax", jitted, got)):
        x = torch.tensor([0.5, -1.0, 2.0, 3.0], device=device, requires_grad=True)
        v = x[1:3]
        out.extend(torch.autograd.grad(f(v), (v, x)))
        out.append(torch.autograd.functional.hessian(f, x.detach()))
        out.extend(torch.autograd.grad(f((x * 2).view(2, 2)), x))
    for a, b in zip(got, want):
        _close(a, b)


# A jitted function that writes an input in place that is not a leaf and requires grad: its
# outputs' gradients reach the input's value before the write, and the input's history is
# the write (torch's in-place op rebases it): on the first call, which traces, and on cached ones.
INPLACE_ON_INPUT = {
    "mul_": lambda y: y.mul_(3).sum(),
    "read_before_write": lambda y: (y.sum(), y.mul_(3))[0],
    "tanh_": lambda y: (y.tanh_() * 2).sum(),
    "through_a_view": lambda y: y.view(3, 1).mul_(3).sum(),
    "returns_the_input": lambda y: (y.sigmoid_(), y * 2),
    "add_": lambda y: y.add_(1).sum() * y.sum(),
    "graph_break_after_write": lambda y: y.mul_(3).sum() if y.sum().item() > -1e9 else y.sum(),
}


@pytest.mark.parametrize("name", sorted(INPLACE_ON_INPUT) + ["input_is_a_view"])
def test_inplace_write_of_a_non_leaf_input(name):
    fn = INPLACE_ON_INPUT.get(name, lambda y: y.mul_(3).sum())
    grads = {}
    for device in ("cpu", "jax"):
        x = torch.linspace(-1.0, 2.0, 3).to(device).requires_grad_()
        run = t2j.jit(fn) if device == "jax" else fn
        for _ in range(2):  # the first call traces, the second is cached
            y = (x * 2).view(3, 1)[:, 0] if name == "input_is_a_view" else x * 2
            out = run(y)
            outs = out if isinstance(out, tuple) else (out,)
            (sum(o.sum() for o in outs) + (y * y).sum()).backward()
        grads[device] = x.grad
    torch.testing.assert_close(grads["jax"].cpu(), grads["cpu"], rtol=1e-5, atol=1e-5)


def test_jitted_module_with_an_inplace_activation_first():
    """`t2j.jit(head)(stem(x))` where head starts with SiLU(inplace=True): stem's gradients."""
    torch.manual_seed(0)
    stem, head = nn.Linear(4, 4), nn.Sequential(nn.SiLU(inplace=True), nn.Linear(4, 1))
    x = torch.randn(5, 4)
    head(stem(x)).sum().backward()
    stem_j, head_j = copy.deepcopy(stem).to("jax"), copy.deepcopy(head).to("jax")
    jitted = t2j.jit(head_j)
    for _ in range(2):
        for p in (*stem_j.parameters(), *head_j.parameters()):
            p.grad = None
        jitted(stem_j(x.to("jax"))).sum().backward()
    for got, want in zip((*stem_j.parameters(), *head_j.parameters()), (*stem.parameters(), *head.parameters())):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-6)


def test_parameters_no_used_output_reaches_get_no_gradient():
    """A jitted forward differentiated outside: parameters behind a ``detach()`` or used only by an
    output the loss leaves out get None, not zeros (AdamW's weight decay would move them)."""
    results = {}
    for device in ("cpu", "jax"):
        torch.manual_seed(0)
        first, second, third = (torch.nn.Linear(2, 2).to(device) for _ in range(3))

        def forward(x):
            return second(first(x).detach()), third(x)

        run = forward if device == "cpu" else t2j.jit(forward)
        used, unused = run(torch.ones(1, 2, device=device))
        used.sum().backward()
        grads = [p.grad for m in (first, second, third) for p in m.parameters()]
        results[device] = [None if g is None else g.tolist() for g in grads]
        unused.sum().backward()
        results[device].append(third.weight.grad.tolist())
    assert results["jax"] == results["cpu"]
    assert results["jax"][:2] == [None, None] and results["jax"][4:6] == [None, None]

def test_inputs_reached_only_through_integer_values_get_no_gradient():
    """Comparisons, argmax and integer casts cut torch's graph: an input the output reaches only
    through them gets None (the program's dependencies used to count them, giving zeros)."""

    def f(w, x, z):
        return (w * (x > 0).float() + w * x.argmax() + z.long().float()).sum()

    results = {}
    for device in ("cpu", "jax"):
        torch.manual_seed(0)
        w, x, z = (torch.randn(4).to(device).requires_grad_() for _ in range(3))
        (f if device == "cpu" else t2j.jit(f))(w, x, z).backward()
        results[device] = [None if t.grad is None else t.grad.tolist() for t in (w, x, z)]
    assert results["jax"] == results["cpu"] and results["cpu"][1:] == [None, None]



def test_leaves_made_inside_come_back_as_leaves_that_require_grad():
    # a PGD-style init (``zeros_like(x).uniform_().requires_grad_()``), torch.ones(requires_grad=True) and
    # an nn.Parameter made inside: new leaves requiring grad on every call, as in eager
    def make(x):
        delta = torch.zeros_like(x).uniform_(-0.1, 0.1).requires_grad_()
        return delta, torch.ones(2, device=x.device, requires_grad=True), nn.Parameter(x * 2), x * 3

    run = t2j.jit(make)
    x = torch.ones(2, device="jax", requires_grad=True)
    for call in range(2):
        delta, ones, param, y = run(x)
        for leaf in (delta, ones, param):
            assert leaf.requires_grad and leaf.is_leaf and leaf.grad_fn is None
        assert isinstance(param, nn.Parameter) and y.grad_fn is not None
        ((1 + delta) ** 2).sum().backward()
        torch.testing.assert_close(delta.grad, 2 * (1 + delta.detach()))
        (param.sum() + ones.sum() + y.sum()).backward()
        assert param.grad.tolist() == [1.0, 1.0] and ones.grad.tolist() == [1.0, 1.0]
        assert x.grad.tolist() == [3.0 * (call + 1)] * 2


def test_a_leaf_made_and_differentiated_inside_comes_back_with_its_grad():
    # (a PGD attack's step: the perturbation's gradient read after the call)
    def attack(x):
        delta = torch.zeros_like(x).requires_grad_()
        ((x + delta) ** 2).sum().backward()
        return delta, delta.grad, torch.ones(1, device=x.device, requires_grad=True)

    def run(device, f):
        out = []
        for i in range(3):
            delta, grad, untouched = f(torch.full((3,), float(i + 1), device=device))
            out.append((delta.is_leaf, delta.requires_grad, delta.grad.tolist(), delta.grad is grad, untouched.grad))
        return out

    assert run("jax", t2j.jit(attack)) == run("cpu", attack)


def test_cholesky_in_a_jitted_forward_differentiates_as_torch():
    # torch's gradient of a factor is Hermitian whatever the upper triangle holds (JAX's own is not)
    torch.manual_seed(0)
    b = torch.randn(4, 4, dtype=torch.float64)
    a = b @ b.T + 4 * torch.eye(4, dtype=torch.float64) + torch.triu(torch.randn(4, 4, dtype=torch.float64), 1)
    w = torch.randn(4, 4, dtype=torch.float64)
    grads = []
    for device, f in (("cpu", torch.linalg.cholesky), ("jax", t2j.jit(torch.linalg.cholesky))):
        x = a.to(device).detach().requires_grad_()
        (f(x) * w.to(device)).sum().backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("f", [lambda x: (x.exp() * x).sum(), lambda x: (x + 1).sum(), torch.sigmoid, lambda x: x * 2],
                         ids=["saves", "saves_nothing", "saves_its_result", "writable_result"])
def test_the_graph_of_a_jitted_forward_frees_and_checks_what_torch_saved(f):
    # a second backward without retain_graph, and one after the result was written in place, raise
    # where torch's graph saved tensors (and only there); retain_graph keeps it
    def run(device, fn):
        out = []
        for attempt in ("twice", "retained", "written"):
            x = torch.tensor([0.5, -1.0, 2.0], device=device, requires_grad=True)
            y = fn(x)
            try:
                if attempt == "written":
                    y.mul_(2)
                    y.sum().backward()
                else:
                    y.sum().backward(retain_graph=attempt == "retained")
                    y.sum().backward()
                out.append((attempt, x.grad.tolist()))
            except RuntimeError as e:
                out.append((attempt, str(e)[:40]))
        return out

    assert run("jax", t2j.jit(f)) == run("cpu", f)


def _write_saved_view(a):
    y = a.exp()  # (exp saves its result)
    y[1:3].mul_(2)
    return y.sum()


def _write_saved_detached(a):
    y = a * 3
    z = y * y  # (mul saves y)
    y.detach().zero_()
    return z.sum()


def _write_unsaved(a):
    y = a + 1  # (add saves nothing)
    y.mul_(2)
    return y.sum()


@pytest.mark.parametrize("f", [_write_saved_view, _write_saved_detached, _write_unsaved])
def test_a_tensor_saved_for_backward_then_written_inside_a_jitted_forward_fails_its_backward(f):
    def run(device, fn):
        x = torch.tensor([0.5, -1.0, 2.0], device=device, requires_grad=True)
        y = fn(x)  # (the forward itself runs, as in torch)
        try:
            y.backward()
        except RuntimeError as e:
            return y.item(), str(e)[:60]
        return y.item(), x.grad.tolist()

    got, expected = run("jax", t2j.jit(f)), run("cpu", f)
    assert got[1] == expected[1] if isinstance(expected[1], str) else got[1] == pytest.approx(expected[1])
    assert got[0] == pytest.approx(expected[0])


def test_a_gradient_penalty_through_a_jitted_forward_leaves_unreached_parameters_without_grad():
    # d(dy/dx)/d(last bias) has no path: None, as in torch (an optimizer then skips it), not zeros
    def run(device, wrap):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
        g, = torch.autograd.grad(wrap(m)(x).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
        return [None if p.grad is None else p.grad.cpu() for p in m.parameters()]

    expected, got = run("cpu", lambda m: m), run("jax", t2j.jit)
    assert [g is None for g in got] == [e is None for e in expected] == [False, False, False, True]
    for g, e in zip(got[:3], expected[:3]):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("hooks", ["tensor hook", "retain_grad", "full backward pre-hook"])
def test_a_jitted_forward_with_gradient_hooks_differentiated_outside_runs_them(hooks):
    # (a gradient reversal layer, DANN's): the call's backward is JAX's, which runs no torch hook, so
    # such a forward runs eagerly, with a warning, and the hooks run as in torch
    class Reversal(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            if hooks == "tensor hook":
                h.register_hook(lambda g: -g)
            elif hooks == "retain_grad":
                h.retain_grad()
                self.h = h
            return self.b(h)

    def run(device, wrap):
        torch.manual_seed(0)
        m = Reversal().to(device)
        if hooks == "full backward pre-hook":
            m.a.register_full_backward_pre_hook(lambda mod, go: (go[0] * 0,))
        wrap(m)(torch.ones(5, 3, device=device)).sum().backward()
        out = [m.a.bias.grad.cpu()]
        return out + [m.h.grad.cpu()] if hooks == "retain_grad" else out

    expected = run("cpu", lambda m: m)
    with pytest.warns(UserWarning, match="gradient hooks"):
        got = run("jax", t2j.jit)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("op", ["matrix_exp", "polygamma", "zeta"])
def test_ops_with_loops_of_data_dependent_length_in_a_jitted_forward_differentiate(op):
    # (matrix_exp's squarings, zeta's shift of q: loops JAX's reverse mode cannot go through)
    torch.manual_seed(0)
    f = {"matrix_exp": torch.linalg.matrix_exp, "polygamma": lambda a: torch.polygamma(2, a),
         "zeta": lambda a: torch.special.zeta(3.5, a)}[op]
    a = torch.randn(3, 4, 4, dtype=torch.float64) * torch.tensor([0.1, 3.0, 40.0], dtype=torch.float64)[:, None, None]
    if op != "matrix_exp":
        a = a.abs() + 0.5
    w = torch.randn(a.shape, dtype=torch.float64)
    grads = []
    for device, fn in (("cpu", f), ("jax", t2j.jit(f))):
        x = a.to(device).detach().requires_grad_()
        (fn(x) * w.to(device)).sum().backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-7, atol=1e-7 * grads[0].abs().max().item())


def test_a_vmapped_backward_through_a_jitted_forward():
    # jacobian(vectorize=True) and is_grads_batched=True (torch's legacy vmap over the backward
    # pass) and torch.func.vmap over autograd.grad: the call's VJP is vmapped over the cotangents
    def f(x):
        return torch.sin(x) * x.sum()

    x = torch.randn(3, dtype=torch.float64)
    expected = torch.autograd.functional.jacobian(f, x)
    xj = x.to("jax")
    run = t2j.jit(f)
    torch.testing.assert_close(torch.autograd.functional.jacobian(run, xj, vectorize=True).cpu(), expected)
    leaf = xj.clone().requires_grad_()
    y, eye = run(leaf), torch.eye(3, dtype=torch.float64, device="jax")
    torch.testing.assert_close(torch.autograd.grad(y, leaf, eye, is_grads_batched=True, retain_graph=True)[0].cpu(),
                               expected)
    rows = torch.func.vmap(lambda v: torch.autograd.grad(y, leaf, v, retain_graph=True)[0])(eye)
    torch.testing.assert_close(rows.cpu(), expected)
    with pytest.raises(RuntimeError, match="vmapped backward pass that creates a graph"):
        torch.autograd.grad(y, leaf, eye, is_grads_batched=True, create_graph=True)
    # (second order: the backward's own JAX call is vmapped too)
    hessian = torch.autograd.functional.hessian(lambda x: run(x).sum(), xj, vectorize=True)
    torch.testing.assert_close(hessian.cpu(), torch.autograd.functional.hessian(lambda x: f(x).sum(), x))


@pytest.mark.parametrize("index", [1, (slice(None), 2)])
def test_a_non_leaf_view_argument_written_in_place(index):
    # y[1].mul_(3) inside: the call writes the view's part of y's storage, and y's history goes
    # through the call as torch's in-place op would make it (was: a broadcast-shape error)
    def run(device, f):
        w = torch.arange(1.0, 7.0, device=device).reshape(2, 3).requires_grad_()
        y = w * 2
        total = 0.0
        for _ in range(2):
            total = total + f(y[index])
        (total + (y ** 2).sum()).backward()
        return total.detach().cpu(), y.detach().cpu(), w.grad.cpu()

    def f(v):
        return v.mul_(3).sum()

    for got, expected in zip(run("jax", t2j.jit(f)), run("cpu", f)):
        torch.testing.assert_close(got, expected)


def test_index_put_with_repeated_indices_differentiates_as_torch():
    # every value an index names gets its position's gradient, repeats too (JAX's scatter gave it
    # to the value written last only); jax.hessian of the same code still runs (forward mode)
    def f(x, v):
        y = x.clone()
        y[torch.tensor([0, 0, 2], device=x.device)] = v
        return (y * torch.arange(1.0, 4.0, device=x.device)).sum()

    grads = []
    for device, run in (("cpu", f), ("jax", t2j.jit(f))):
        x = torch.ones(3, device=device, requires_grad=True)
        v = torch.full((3,), 2.0, device=device, requires_grad=True)
        run(x, v).backward()
        grads.append((x.grad.cpu(), v.grad.cpu()))
    torch.testing.assert_close(grads[1], grads[0])

    def g(a):
        x = new_tensor(a)
        y = x.clone()
        y[torch.tensor([0, 0, 2], device="jax")] = x[:3] * 2
        return (y * y).sum().jax()

    assert jax.hessian(g)(jax.numpy.arange(1.0, 5.0)).shape == (4, 4)


@pytest.mark.parametrize("f", [
    lambda a: torch.linalg.eigvals(a).abs().sum(),
    lambda a: (lambda w, v: w.real.sum() + v.abs().pow(2).mul(torch.arange(4.0, device=a.device)).sum())(
        *torch.linalg.eig(a)),
], ids=["eigvals", "eig"])
def test_eigen_decomposition_of_a_general_matrix_differentiates_through_a_jitted_forward(f):
    # JAX differentiates the program: eigenvectors' derivatives as torch's (unit norm, phase-invariant loss)
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    cpu, jx = a.clone().requires_grad_(), a.to("jax").requires_grad_()
    f(cpu).backward()
    t2j.jit(f)(jx).backward()
    torch.testing.assert_close(jx.grad.cpu(), cpu.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_hook_registered_by_a_trace_that_stops_is_registered_once(hook):
    def double_grad(p):
        p.grad.mul_(2)

    def f(x):
        if hook == "register_hook":
            x.register_hook(lambda g: g * 2)
        else:
            x.register_post_accumulate_grad_hook(double_grad)
        nonzero = (x > 0).nonzero()  # a graph break: the call runs eagerly after the trace stops
        (x * 3).sum().backward()
        return nonzero

    x = torch.ones(3, requires_grad=True)
    f(x)
    on_device = torch.ones(3, device="jax", requires_grad=True)
    with pytest.warns(UserWarning, match="runs eagerly"):
        t2j.jit(f)(on_device)
    torch.testing.assert_close(on_device.grad.cpu(), x.grad)


def test_a_gradient_through_overlapping_as_strided_windows_inside_the_step():
    def f(x):
        x.as_strided((3, 3), (1, 1)).sum().backward()
        return x.grad

    x = torch.randn(6, requires_grad=True)
    expected = f(x)
    for _ in range(2):
        on_device = torch.randn(6, device="jax", requires_grad=True)
        torch.testing.assert_close(t2j.jit(f, fullgraph=True)(on_device).cpu(), expected)


_T = torch.tensor
_KINKS = {
    # torch's choice at a kink (relu'(0) = 0, a clamp passing the gradient at its bounds, ties to the returned
    # index), or a finite gradient where a JAX-differentiated formula gives NaN
    "relu at 0": (F.relu, _T([0.0, 1.0, -1.0])),
    "abs at 0": (torch.abs, _T([0.0, 1.0, -1.0])),
    "clamp at its bounds": (lambda x: x.clamp(0.0, 1.0), _T([0.0, 1.0, 0.5, 2.0])),
    "clamp with tensor bounds": (lambda x, lo: x.clamp(min=lo), _T([1.0, 0.0, 2.0]), _T([1.0, 1.0, 1.0])),
    "relu6 at its bounds": (F.relu6, _T([0.0, 6.0, 3.0])),
    "hardtanh at its bounds": (F.hardtanh, _T([-1.0, 1.0, 0.5])),
    "hardsigmoid at its kinks": (F.hardsigmoid, _T([-3.0, 3.0, 0.0])),
    "hardswish at its kinks": (F.hardswish, _T([-3.0, 3.0, 0.0])),
    "softplus past its threshold": (F.softplus, _T([0.0, 100.0, -100.0, 30.0])),
    "bce with logits at 0": (lambda x: F.binary_cross_entropy_with_logits(x, _T([0.3, 1.0, 0.0]).to(x.device),
                                                                          reduction="none"), _T([0.0, 0.0, 2.0])),
    "bernoulli log_prob at p 0.5": (lambda p: torch.distributions.Bernoulli(probs=p).log_prob(torch.ones_like(p)),
                                    _T([0.5, 0.2])),
    "log_ndtr at 0": (torch.special.log_ndtr, _T([0.0, 1.0, -1.0])),
    "xlogy at x 0": (torch.xlogy, _T([0.0, 0.0, 1.0]), _T([0.0, 2.0, 2.0])),
    "fmax tie": (torch.fmax, _T([1.0, 2.0]), _T([1.0, 1.0])),
    "fmin tie": (torch.fmin, _T([1.0, 0.0]), _T([1.0, 1.0])),
    "max(dim) tie": (lambda x: x.max(-1).values, _T([[1.0, 1.0, 0.0]])),
    "min(dim) tie": (lambda x: x.min(-1).values, _T([[0.0, 0.0, 1.0]])),
    "norm of zeros": (lambda x: torch.linalg.vector_norm(x, dim=-1), _T([[0.0, 0.0], [3.0, 4.0]])),
    "3-norm of zeros": (lambda x: torch.linalg.vector_norm(x, 3, dim=-1), _T([[0.0, 0.0], [3.0, 4.0]])),
    "normalize zeros": (lambda x: F.normalize(x, dim=-1), _T([[0.0, 0.0], [3.0, 4.0]])),
    "std of a constant": (lambda x: x.std(-1), _T([[2.0, 2.0, 2.0], [1.0, 2.0, 4.0]])),
    "0 ** 0": (torch.pow, _T([0.0, 0.0, 2.0, -2.0]), _T([0.0, 2.0, 0.0, 0.5])),
    "x ** 0.0 at 0": (lambda x: x ** 0.0 + x ** 1.0, _T([0.0, 1.0])),
    "atan2 at the origin": (torch.atan2, _T([0.0, 1.0]), _T([0.0, 1.0])),
    "copysign at 0": (torch.copysign, _T([0.0, 1.0, -2.0]), _T([-1.0, -1.0, 3.0])),
    "logit at 0 and 1": (torch.logit, _T([0.0, 1.0, 0.5])),
    "xlog1py at y -1": (torch.special.xlog1py, _T([0.0, 1.0]), _T([-1.0, 1.0])),
    "bce of a saturated sigmoid": (lambda x: F.binary_cross_entropy(torch.sigmoid(x), _T([1.0, 0.0, 1.0]).to(x.device),
                                                                    reduction="none"), _T([20.0, -20.0, 0.5])),
    "bce at 0 and 1": (lambda p, t: F.binary_cross_entropy(p, t, reduction="none"), _T([0.0, 1.0, 0.3]),
                       _T([0.0, 1.0, 1.0])),
    "cdist of equal rows": (torch.cdist, _T([[1.0, 2.0]]), _T([[1.0, 2.0], [0.0, 0.0]])),
    "cdist p=1, inf, 3 at 0": (lambda a, b: torch.cat([torch.cdist(a, b, p) for p in (1.0, float("inf"), 3.0, 0.5)]),
                               _T([[1.0, 2.0], [0.0, 0.0]]), _T([[1.0, 2.0], [1.0, 1.0]])),
    "cdist by matrix products": (lambda a, b: torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist"),
                                 _T([[1.0, 2.0]]), _T([[1.0, 2.0], [0.0, 0.0]])),
    "pdist of equal rows": (F.pdist, _T([[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]])),
    "1-norm at 0": (lambda x: torch.linalg.vector_norm(x, 1), _T([0.0, 1.0])),
    "median tie": (torch.median, _T([1.0, 2.0, 2.0, 2.0, 3.0])),
    "nanmedian tie": (torch.nanmedian, _T([1.0, float("nan"), 2.0, 2.0])),
    "nll with every target ignored": (lambda x: F.nll_loss(x, torch.tensor([1, 1], device=x.device), ignore_index=1),
                                      _T([[0.1, 0.2], [0.3, 0.4]])),
    "embedding padding row": (lambda w: F.embedding(torch.tensor([0, 1, 2, 2], device=w.device), w, padding_idx=2),
                              _T([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])),
    "embedding scaled by frequency": (lambda w: F.embedding(torch.tensor([0, 1, 1], device=w.device), w,
                                                            scale_grad_by_freq=True), _T([[1.0, 2.0], [3.0, 4.0]])),
    "ctc of log-probabilities": (lambda lp: F.ctc_loss(lp, torch.tensor([[1, 2], [3, 3]], device=lp.device),
                                                       torch.tensor([3, 2]), torch.tensor([2, 1]), reduction="sum"),
                                 torch.linspace(-3, 1, 24).reshape(3, 2, 4).log_softmax(2)),
    "tanh transform log-det far out": (lambda x: torch.distributions.transforms.TanhTransform().log_abs_det_jacobian(
        x, torch.tanh(x)), _T([-50.0, 0.0, 50.0])),
}


@pytest.mark.parametrize("case", _KINKS)
def test_a_jitted_forward_differentiated_outside_has_torch_gradients(case):
    # (its backward differentiates the lowered forward with JAX: each lowering's derivative is torch's)
    fn, *values = _KINKS[case]

    def grads(device, f):
        xs = [v.to(device).requires_grad_() for v in values]
        return [g.cpu() for g in torch.autograd.grad(f(*xs).sum(), xs)]

    for got, want in zip(grads("jax", t2j.jit(fn)), grads("cpu", fn)):
        torch.testing.assert_close(got, want, equal_nan=True)


def test_an_input_its_graph_saved_written_after_the_call_fails_the_backward():
    # as torch's version check: w was saved for x's gradient, x for w's; b (added) was saved by nothing
    for device, wrap in (("cpu", lambda f: f), ("jax", t2j.jit)):
        w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, requires_grad=True)
        b = torch.zeros(2, device=device, requires_grad=True)
        x = torch.ones(1, 2, device=device, requires_grad=True)
        y = wrap(lambda x: x @ w + b)(x)
        with torch.no_grad():
            b.add_(1)
        y.sum().backward(retain_graph=True)
        assert x.grad.cpu().tolist() == [[3.0, 7.0]]
        with torch.no_grad():
            w.mul_(10)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
