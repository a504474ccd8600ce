"""Branches on small integer state under t2j.jit (torch2jax.hints): a program per outcome,
guarded by host values of the state, against torch on the CPU."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import torch2jax as t2j
from programs_util import _train_step


def _train(device, make_ema, steps=6, between=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.BatchNorm1d(8), nn.Linear(8, 1)).to(device)
    ema = make_ema(model)
    opt = torch.optim.Adam(model.parameters(), 1e-2)

    def step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        ema.update_parameters(model)
        return loss.detach()

    run = t2j.jit(step, fullgraph=True) if device == "jax" else step
    losses = []
    for i in range(steps):
        if between is not None:
            between(i, ema)
        losses.append(run(torch.randn(16, 4, generator=torch.Generator().manual_seed(i)).to(device)).item())
    state = [t.detach().cpu() for t in [*ema.parameters(), *ema.buffers()]]
    return losses, state, getattr(run, "stats", None), ema


@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_averaged_model_compiles_one_program_per_branch(kind):
    def make(model):
        if kind == "ema":
            return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        return AveragedModel(model)

    want, got = _train("cpu", make), _train("jax", make)
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)
    # the first call copies (n_averaged == 0), every later one averages
    assert got[2]["traces"] == 2 and got[2]["eager_calls"] == 0 and got[2]["hits"] == 4
    # the counter's next value is known on the host without reading it from the device
    st = got[3].n_averaged._t2j_storage
    assert st.host is not None and st.host[0] is st.array and int(st.host[1]) == 6


def test_state_reset_outside_takes_the_first_branch_again():
    def reset(i, ema):
        if i == 3:
            ema.n_averaged.zero_()

    want, got = _train("cpu", AveragedModel, between=reset), _train("jax", AveragedModel, between=reset)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)
    # (the copy branch with .grad filled is a third program)
    assert got[2]["traces"] == 3 and got[2]["hits"] == 3


class _WarmUp(nn.Module):
    """Doubles its input for its first calls, then scales by a learned weight; counts in a buffer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(3.0))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int32))
        self.register_buffer("saw_negative", torch.zeros((), dtype=torch.bool))

    def forward(self, x):
        out = x * 2 if self.calls < 2 else x * self.w
        if self.saw_negative:  # set from the data by the last call: no host mirror, read when checked
            out = out - 1
        self.saw_negative.copy_((x < 0).any())
        self.calls += 1
        return out


def test_a_warm_up_counter_and_a_data_flag():
    def run(device):
        m = _WarmUp().to(device)
        f = t2j.jit(m, fullgraph=True) if device == "jax" else m
        xs = [torch.tensor([1.0, 2.0]), torch.tensor([-1.0, 2.0]), torch.tensor([1.0, 2.0]),
              torch.tensor([3.0, -2.0]), torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0])]
        return [f(x.to(device)).cpu() for x in xs], getattr(f, "stats", None)

    (want, _), (got, stats) = run("cpu"), run("jax")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # (calls < 2, saw_negative): (T, F), (T, F), (F, T), (F, F), (F, T), (F, F)
    assert stats["traces"] == 3 and stats["eager_calls"] == 0


def test_a_branch_on_a_parameter_still_stops_the_trace():
    m = nn.Linear(2, 1).to("jax")

    def f(x):
        return m(x) * 2 if m.bias > 0 else m(x)

    with pytest.raises(t2j.OpError, match="bool\\(\\) of a traced value"):
        t2j.jit(f, fullgraph=True)(torch.ones(1, 2, device="jax"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_norm_cumulative_average_compiles_once(dtype):
    # momentum=None averages with 1 / float(num_batches_tracked): a traced float, one program for every count
    def run(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None), nn.Linear(4, 1)).to(device, dtype)
        opt = torch.optim.SGD(model.parameters(), 0.1)

        def step(x):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        run = t2j.jit(step, fullgraph=True) if device == "jax" else step
        xs = [torch.randn(8, 3, generator=torch.Generator().manual_seed(i), dtype=dtype) for i in range(5)]
        losses = [run(x.to(device)).cpu() for x in xs]
        return losses, [t.detach().cpu() for t in model.state_dict().values()], getattr(run, "stats", None)

    (want, want_state, _), (got, got_state, stats) = run("cpu"), run("jax")
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_state, want_state)
    # (the first call creates the .grad the second finds)
    assert stats["traces"] == 2 and stats["eager_calls"] == 0 and stats["hits"] == 3


def test_batch_norm_cumulative_average_under_jax_jit():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3, momentum=None)
    fn, state = t2j.functionalize(copy.deepcopy(bn).to("jax"))
    apply = jax.jit(fn.apply)
    for i in range(3):
        x = torch.randn(8, 3)
        want = bn(x)
        got, state = apply(state, jnp.asarray(x.numpy()))
        torch.testing.assert_close(torch.from_numpy(np.asarray(got)), want.detach())
    for name, value in bn.named_buffers():
        torch.testing.assert_close(torch.from_numpy(np.asarray(state["buffers"][name])), value)


def test_float_of_a_counter_stops_the_trace():
    # each value would be a program of its own: the exact value is not taken from the host
    count = torch.zeros((), dtype=torch.long, device="jax")

    def f(x):
        count.add_(1)
        return x / float(count)

    with pytest.raises(t2j.OpError, match="of a traced value computed from a one-element integer tensor"):
        t2j.jit(f, fullgraph=True)(torch.randn(4, 3, device="jax"))


class _ActNorm(nn.Module):
    """Glow's ActNorm: the first batch sets the parameters, a uint8 buffer says it has."""

    def __init__(self, c):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, c))
        self.scale = nn.Parameter(torch.ones(1, c))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x):
        if self.initialized.item() == 0:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0, keepdim=True))
                self.scale.data.copy_(1 / (x.std(0, keepdim=True) + 1e-6))
                self.initialized.fill_(1)
        return self.scale * (x + self.loc)


def test_data_dependent_initialization_on_the_first_call():
    def run(device):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 4), _ActNorm(4), nn.Linear(4, 1)).to(device)
        step = _train_step(m, torch.optim.SGD(m.parameters(), 0.1), lambda model, x: model(x).pow(2).mean())
        f = t2j.jit(step, fullgraph=True) if device == "jax" else step
        losses = [f(torch.randn(8, 3, generator=torch.Generator().manual_seed(i)).to(device)).item() for i in range(5)]
        return losses, [p.detach().cpu() for p in m.parameters()], getattr(f, "stats", None)

    want, got = run("cpu"), run("jax")
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)
    assert got[2]["traces"] == 2 and got[2]["hits"] == 3
