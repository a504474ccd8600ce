"""t2j.train.make_train_step (optax) against torch.optim on torch CPU."""

from __future__ import annotations

import copy
import io

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


def test_loss_reading_parameters_outside_the_forward_is_differentiated():
    # an L2 penalty over m.parameters() and a term on one weight: both reach the step's parameters
    def loss_fn(m, x, y):
        penalty = sum((p ** 2).sum() for p in m.parameters())
        return F.mse_loss(m(x), y) + 1e-2 * penalty + m[3].bias.sum()

    ref = _model()
    model = copy.deepcopy(ref).to("jax")
    step = t2j.train.make_train_step(model, loss_fn, optax.sgd(0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        expected = loss_fn(ref, x, y)
        expected.backward()
        opt.step()
        torch.testing.assert_close(step(x, y).cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4, msg=n)
    assert all(isinstance(p, nn.Parameter) or getattr(p, "_is_param", False) for p in model.parameters())


def test_module_on_cpu_is_rejected():
    with pytest.raises(TypeError, match="jax device"):
        t2j.train.make_train_step(nn.Linear(2, 2), lambda m, x: m(x).sum(), optax.sgd(0.1))


def test_a_checkpoint_of_a_jitted_adam_step_loads_into_an_optimizer_on_the_cpu():
    # a jitted step keeps Adam's step counters on the jax device (its capturable form); loaded
    # for parameters on the CPU they come back on the CPU, as a CUDA run's do, so the CPU
    # optimizer's foreach step (which groups them by device) runs
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    cpu_model = copy.deepcopy(model)
    on_jax = model.to("jax")
    opt = torch.optim.Adam(on_jax.parameters(), lr=1e-2, foreach=True)
    cpu_opt = torch.optim.Adam(cpu_model.parameters(), lr=1e-2, foreach=True)

    @t2j.jit
    def step(x):
        opt.zero_grad()
        on_jax(x).sum().backward()
        opt.step()

    for _ in range(2):
        step(torch.ones(2, 3, device="jax"))
        cpu_opt.zero_grad()
        cpu_model(torch.ones(2, 3)).sum().backward()
        cpu_opt.step()
    buffer = io.BytesIO()
    torch.save({"model": on_jax.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = nn.Linear(3, 2)
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2, foreach=True)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed_opt.state[resumed.weight]["step"].device.type == "cpu"
    for m, o in ((resumed, resumed_opt), (cpu_model, cpu_opt)):
        o.zero_grad()
        m(torch.ones(2, 3)).sum().backward()
        o.step()
    torch.testing.assert_close(resumed.weight.detach(), cpu_model.weight.detach())


def test_loss_with_aux_returns_it_and_bad_losses_are_named():
    ref = nn.Linear(3, 2)
    model = copy.deepcopy(ref).to("jax")

    def loss_fn(m, x):
        out = m(x)
        return out.pow(2).mean(), {"mean": out.mean(), "max": out.max().item()}

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    loss, aux = t2j.train.make_train_step(model, loss_fn, optax.sgd(0.1), has_aux=True)(x)
    want, want_aux = loss_fn(ref, x)
    torch.testing.assert_close(loss.cpu(), want.detach())
    torch.testing.assert_close(aux["mean"].cpu(), want_aux["mean"].detach())
    torch.testing.assert_close(aux["max"].cpu(), torch.tensor(want_aux["max"]))
    for bad, error, match in [(loss_fn, TypeError, "got tuple; for \\(loss, aux\\) pass has_aux=True"),
                              (lambda m, x: 1.0, TypeError, "scalar loss tensor .* got float"),
                              (lambda m, x: m(x), ValueError, "got one of shape \\(4, 2\\)")]:
        with pytest.raises(error, match="make_train_step: .*" + match):
            t2j.train.make_train_step(model, bad, optax.sgd(0.1))(x)


def test_python_ints_bools_and_strings_in_the_batch_are_static():
    def loss_fn(m, x, n, neg, mode):
        out = -m(x[:n]) if neg else m(x[:n])
        return out.pow(2).mean() if mode == "mse" else out.abs().mean()

    ref = nn.Linear(4, 1)
    model = copy.deepcopy(ref).to("jax")
    step = t2j.train.make_train_step(model, loss_fn, optax.sgd(0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for n, neg, mode in [(4, True, "mse"), (6, False, "l1"), (4, True, "mse")]:
        opt.zero_grad()
        want = loss_fn(ref, x, n, neg, mode)
        want.backward()
        opt.step()
        torch.testing.assert_close(step(x, n, neg, mode=mode).cpu(), want.detach())
    torch.testing.assert_close(model.weight.detach().cpu(), ref.weight.detach())
