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
