"""t2j.train.make_train_step (optax) against torch.optim on torch CPU."""

from __future__ import annotations

import copy

import jax
import optax
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2jax as t2j


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))


@pytest.mark.parametrize("remat", [None, True, jax.checkpoint_policies.dots_saveable])
def test_optax_sgd_matches_torch_sgd(remat):
    ref = _model()
    model = copy.deepcopy(ref).to("jax")
    step = t2j.train.make_train_step(model, lambda m, x, y: F.cross_entropy(m(x), y), optax.sgd(0.1), remat=remat)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        expected = F.cross_entropy(ref(x), y)
        expected.backward()
        opt.step()
        torch.testing.assert_close(step(x, y).cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4, msg=n)
    for (n, b), r in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b.cpu(), r, atol=1e-5, rtol=1e-4, msg=n)


def test_optax_adamw_loss_decreases_and_module_stays_usable():
    model = _model().to("jax")
    step = t2j.train.make_train_step(model, lambda m, x, y: F.mse_loss(m(x), y), optax.adamw(1e-2))
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    losses = [step(x, y).item() for _ in range(20)]
    assert losses[-1] < 0.7 * losses[0]
    model.eval()
    assert model(x.to("jax")).shape == (32, 4)


def test_module_on_cpu_is_rejected():
    with pytest.raises(TypeError, match="jax device"):
        t2j.train.make_train_step(nn.Linear(2, 2), lambda m, x: m(x).sum(), optax.sgd(0.1))
