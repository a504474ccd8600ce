"""t2j.compile(module) against torch CPU: outputs, parameter and input gradients, buffers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torch2jax as t2j


def _pair(module):
    torch.manual_seed(0)
    ref = module()
    return ref, copy.deepcopy(ref).to("jax")


def test_forward_and_gradients_match_torch():
    ref, model = _pair(lambda: nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)))
    cm = t2j.compile(model)
    ids = torch.randint(0, 10, (4, 5))
    out = cm(ids.to("jax"))
    expected = ref(ids)
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_input_gradients_and_cache_per_shape():
    ref, model = _pair(lambda: nn.Linear(8, 2))
    cm = t2j.compile(model)
    for n in (3, 3, 5, 5, 3):
        x = torch.randn(n, 8, requires_grad=True)
        xj = x.detach().to("jax").requires_grad_(True)
        cm(xj).tanh().sum().backward()
        ref(x).tanh().sum().backward()
        torch.testing.assert_close(xj.grad.cpu(), x.grad, atol=1e-6, rtol=1e-5)
    # one trace per shape: the .grad the first backward made is no state of a forward that never reads it
    assert cm._forward.stats["traces"] == 2


def test_batchnorm_buffers_with_and_without_grad():
    ref, model = _pair(lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)))
    cm = t2j.compile(model)
    x = torch.randn(8, 4)
    cm(x.to("jax")).sum().backward()
    ref(x).sum().backward()
    with torch.no_grad():
        cm(x.to("jax") * 2)
        ref(x * 2)
    for (n, b), r in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b.cpu(), r, atol=1e-6, rtol=1e-5, msg=n)


def test_dropout_masks_differ_between_calls():
    cm = t2j.compile(nn.Dropout(0.5).to("jax"))
    x = torch.ones(64, device="jax", requires_grad=True)
    a, b = cm(x), cm(x)
    assert not torch.equal(a.detach().cpu(), b.detach().cpu())


class _Reversal(nn.Module):
    """Gradient reversal by a tensor hook registered in the forward (domain-adversarial training)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda g: -g)
        return h.tanh().sum()


class _Retained(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        self.h = self.lin(x)
        self.h.retain_grad()
        return self.h.square().sum()


@pytest.mark.filterwarnings("ignore:t2j.jit.*runs eagerly")
def test_hooks_registered_in_the_forward_run():
    for cls in (_Reversal, _Retained):
        ref, model = _pair(cls)
        cm = t2j.compile(model)
        x = torch.randn(5, 4)
        for _ in range(2):
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
            cm(x.to("jax")).backward()
            ref(x).backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5, msg=f"{cls.__name__}.{n}")
        if cls is _Retained:
            torch.testing.assert_close(model.h.grad.cpu(), ref.h.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:t2j.jit.*runs eagerly")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_module_backward_hooks_run():
    ref, model = _pair(lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1)))
    seen = {"cpu": [], "jax": []}
    for m, where in ((ref, "cpu"), (model, "jax")):
        m[1].register_full_backward_hook(lambda mod, gi, go, where=where: seen[where].append(go[0].detach().cpu()))
        m[0].register_full_backward_pre_hook(lambda mod, go, where=where: (go[0] * 2,))
    x = torch.randn(5, 4)
    t2j.compile(model)(x.to("jax")).sum().backward()
    ref(x).sum().backward()
    assert len(seen["jax"]) == len(seen["cpu"]) == 1
    torch.testing.assert_close(seen["jax"][0], seen["cpu"][0], atol=1e-5, rtol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5, msg=n)


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


def test_python_state_the_forward_changes():
    ref, model = _pair(_Counting)
    cm = t2j.compile(model)
    x = torch.randn(2, 4)
    for _ in range(4):
        torch.testing.assert_close(cm(x.to("jax")).detach().cpu(), ref(x).detach(), atol=1e-5, rtol=1e-5)
    # (the first trace finds that it advances `calls`: the second makes it a program input)
    assert model.calls == 4 and cm._forward.stats["traces"] == 2 and cm._forward.stats["compiles"] == 1


def test_a_forward_it_cannot_trace_runs_eagerly_or_raises_with_fullgraph():
    x = torch.tensor([1.0, -2.0, 3.0], device="jax", requires_grad=True)
    with pytest.warns(UserWarning, match="eager"):
        out = t2j.compile(_NonzeroSum())(x)
    out.backward()
    assert out.item() == 4.0 and x.grad.cpu().tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(Exception, match="nonzero|value"):
        t2j.compile(_NonzeroSum(), fullgraph=True)(x)


class _NonzeroSum(nn.Module):
    def forward(self, x):
        return x[x > 0].sum()
