"""t2j.compile(module) against torch CPU: outputs, parameter and input gradients, buffers."""

from __future__ import annotations

import copy

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
    for n in (3, 3, 5):
        x = torch.randn(n, 8, requires_grad=True)
        xj = x.detach().to("jax").requires_grad_(True)
        cm(xj).tanh().sum().backward()
        ref(x).tanh().sum().backward()
        torch.testing.assert_close(xj.grad.cpu(), x.grad, atol=1e-6, rtol=1e-5)
    assert len(cm._programs) == 2


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
