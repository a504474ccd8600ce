"""t2j.jit against torch CPU: whole training steps, state write-back, RNG, retracing."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import importlib
import itertools
import math
import types
import sys
import threading
import warnings
import weakref

import jax
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree

import torch2jax as t2j
from programs_util import _train_step

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd_nesterov_wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _classifier_step(model, opt):
    """One training step of a classifier: zero_grad, cross-entropy, backward, optimizer step."""

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _train(device, make_opt, steps=20, jit=False, scheduler=True):
    model = _model().to(device)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) if scheduler else None
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(steps)]

    step = _classifier_step(model, opt)
    if jit:
        step = t2j.jit(step)
    losses = []
    for x, y in data:
        losses.append(step(x.to(device), y.to(device)).item())
        if sched:
            sched.step()
    return losses, model, step


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_train_step_matches_torch(name):
    expected, ref_model, _ = _train("cpu", OPTIMIZERS[name])
    actual, model, step = _train("jax", OPTIMIZERS[name], jit=True)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-4, rtol=1e-3, msg=n)
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-4, rtol=1e-3, msg=n)
    # first call: no grads and no optimizer state; second: both exist; then cached
    assert step.stats["traces"] == 2, t2j.explain_recompiles()
    assert step.stats["hits"] == 18


def test_lr_scheduler_outside_never_retraces():
    _, _, step = _train("jax", OPTIMIZERS["sgd_momentum"], steps=12, jit=True, scheduler=True)
    assert step.stats["traces"] == 2


def test_retrace_on_shape_change_is_explained():
    lin = nn.Linear(4, 2).to("jax")
    f = t2j.jit(lambda x: lin(x).sum())
    f(torch.ones(3, 4))
    f(torch.ones(3, 4))
    assert f.stats["traces"] == 1
    f(torch.ones(5, 4))
    assert f.stats["traces"] == 2
    assert "[3, 4] -> torch.float32 [5, 4]" in t2j.explain_recompiles()[-1]


def test_static_arguments_are_part_of_the_key():
    f = t2j.jit(lambda x, scale, mode="sum": getattr(x * scale, mode)())
    x = torch.arange(4.0, device="jax")
    assert f(x, 2).item() == 12.0
    assert f(x, 3).item() == 18.0
    assert f(x, 3, mode="mean").item() == 4.5
    assert f.stats["traces"] == 3
    assert f(x, 2).item() == 12.0 and f.stats["traces"] == 3


def test_dropout_differs_per_step_and_follows_manual_seed():
    drop = nn.Dropout(0.5)
    f = t2j.jit(lambda x: drop(x))
    x = torch.ones(64, device="jax")
    torch.manual_seed(3)
    a, b = f(x).cpu(), f(x).cpu()
    torch.manual_seed(3)
    c = f(x).cpu()
    assert not torch.equal(a, b)
    assert torch.equal(a, c)
    assert f.stats["traces"] == 1


def test_batchnorm_running_stats_written_back():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    model = copy.deepcopy(ref).to("jax")
    f = t2j.jit(lambda x: model(x))
    for i in range(3):
        x = torch.randn(2, 3, 6, 6)
        torch.testing.assert_close(f(x.to("jax")).cpu(), ref(x), atol=1e-5, rtol=1e-4)
    for (n, b), r in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b.cpu(), r, atol=1e-6, rtol=1e-5, msg=n)


def test_gradient_accumulation_without_zero_grad():
    lin = nn.Linear(3, 1).to("jax")
    ref = copy.deepcopy(lin).cpu()

    @t2j.jit
    def accumulate(x):
        lin(x).pow(2).sum().backward()

    for k in range(3):
        x = torch.full((2, 3), float(k + 1))
        accumulate(x.to("jax"))
        ref(x).pow(2).sum().backward()
    torch.testing.assert_close(lin.weight.grad.cpu(), ref.weight.grad)


def test_argument_and_captured_tensor_mutation():
    counter = torch.zeros((), device="jax")

    @t2j.jit
    def f(x):
        x.add_(1)
        counter.add_(1)
        return x * 2

    y = torch.zeros(3, device="jax")
    out = f(y)
    f(y)
    assert y.tolist() == [2.0, 2.0, 2.0]
    assert counter.item() == 2.0
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_tensor_read_outside_modules_is_not_frozen():
    holder = type("Holder", (), {})()
    holder.scale = torch.ones(2, device="jax")
    f = t2j.jit(lambda x: x * holder.scale)
    x = torch.ones(2, device="jax")
    assert f(x).tolist() == [1.0, 1.0]
    holder.scale.mul_(10)
    assert f(x).tolist() == [10.0, 10.0]


def test_view_of_argument_written():
    @t2j.jit
    def f(x):
        x[:, 0].mul_(3)
        x.t()[1].add_(1)

    x = torch.ones(2, 3, device="jax")
    ref = torch.ones(2, 3)
    f(x)
    ref[:, 0].mul_(3)
    ref.t()[1].add_(1)
    assert torch.equal(x.cpu(), ref)


def test_outputs_that_view_inputs_are_views():
    # as in torch, a returned view of an argument or of a parameter aliases it
    @t2j.jit
    def f(x, lin):
        return x.t(), x.add_(1).view(-1), lin.weight.t(), x * 2

    def run(device):
        x = torch.arange(6.0, device=device).reshape(2, 3)
        lin = torch.nn.Linear(3, 2).to(device)
        t, flat, wt, fresh = (f if device == "jax" else f.__wrapped__)(x, lin)
        t[0, 0] = -7.0
        x[1].mul_(10)
        return [t.stride(), flat.stride(), wt.stride(), fresh.stride(), t._base is x, wt._base is lin.weight,
                t.cpu().tolist(), flat.cpu().tolist(), fresh.cpu().tolist()]

    assert run("jax") == run("cpu")
    run("jax")  # the compiled program again
    w = torch.ones(3, 2, device="jax", requires_grad=True)
    wt, doubled = t2j.jit(lambda a: (a.t(), a * 2))(w)
    (wt.sum() + doubled.sum()).backward()
    assert w.grad.tolist() == [[3.0, 3.0]] * 3


@pytest.mark.parametrize("view", [
    lambda y: y[:, 1:3], lambda y: y[1], lambda y: y.diagonal(), lambda y: y[::2, ::2], lambda y: y.t()[1:],
    lambda y: y.sum(0).expand(3, 4), lambda y: y.unfold(1, 2, 1), lambda y: (y[0], y[0, 1:]),
    lambda y: (y[1:3], y.view(2, 8).t()), lambda y: (y[:2], y[2:]),
], ids=["slice", "row", "diagonal", "steps", "t_slice", "expand", "unfold", "two_views", "overlapping", "disjoint"])
def test_a_view_of_an_intermediate_is_a_view_of_it(view):
    # as in torch: the strides, offset and storage of a view of a tensor the function made (its
    # base is not returned), and a write through one of two such views shows in the other
    f = lambda a: view(a * 2 + 1)  # noqa: E731

    def run(device, fn):
        a = torch.arange(16.0, device=device).reshape(4, 4).requires_grad_()
        out = []
        for _ in range(2):
            o = fn(a)
            o = o if isinstance(o, tuple) else (o,)
            out.append([(v.stride(), v.storage_offset(), v.is_contiguous(), v._base is not None,
                         v.untyped_storage().nbytes(), v.requires_grad) for v in o])
            sum(v.sum() for v in o).backward()
            out.append(a.grad.tolist())
            if len(o) == 2:
                with torch.no_grad():
                    o[0][1] = -1.0
                out.append((o[1].tolist(), o[0]._base is o[1]._base or o[1]._base is o[0]))
        return out

    assert run("jax", t2j.jit(f)) == run("cpu", f)


def _relaid_in_place(q, op, *args):
    getattr(q, op)(*args)
    return q


@pytest.mark.parametrize("program", [
    lambda x: (x * 2).view(torch.int16).view(3, 8)[:, 1],
    lambda x: _relaid_in_place(x * 2, "as_strided_", (2, 2), (4, 1), 1),
    lambda x: (_relaid_in_place(x * 2, "t_"), x[0]),
    lambda x: (lambda q: (q.view(torch.float32)[1:], q))(x * 2),
    lambda x: (lambda q: (q.t().detach(), q.detach()))(x.float().requires_grad_() * 2),
], ids=["dtype_view_of_view", "as_strided_", "t_", "dtype_view_and_base", "detached"])
def test_an_output_on_a_storage_made_inside_keeps_torch_s_layout(program):
    # as torch: a dtype view of an intermediate, a tensor of its own re-laid in place (t_, as_strided_: no
    # _base) and a detach of one keep their strides, offset, storage and _base over calls
    def run(device, fn):
        out = []
        for k in range(2):
            o = fn(torch.arange(12, dtype=torch.int32, device=device).reshape(3, 4) + k)
            o = o if isinstance(o, tuple) else (o,)
            out.append([(v.cpu().tolist(), v.dtype, v.stride(), v.storage_offset(), v._base is None, v._is_view(),
                         v.untyped_storage().data_ptr() == o[0].untyped_storage().data_ptr()) for v in o])
        return out

    assert run("jax", t2j.jit(program)) == run("cpu", program)


@pytest.mark.parametrize("split", [lambda b: b.unbind(0), lambda b: b.split(2), lambda b: b.chunk(2)],
                         ids=["unbind", "split", "chunk"])
def test_views_of_a_multi_output_view_op_refuse_in_place_writes(split):
    # as torch: the outputs of unbind / split / chunk share one autograd node, so writing one in place
    # is refused (while grad mode is on); a plain slice is writable
    def run(device, fn):
        x = torch.arange(1.0, 5.0, device=device).requires_grad_()
        parts = fn(x)
        try:
            parts[0].mul_(3)
        except RuntimeError as e:
            return "view and is being modified inplace" in str(e)
        return parts[0].tolist()

    f = lambda a: (*split(a * 2), (a * 2)[1:])  # noqa: E731
    assert run("jax", t2j.jit(f)) == run("cpu", f) is True
    g = lambda a: (a * 2)[1:]  # noqa: E731
    assert run("jax", lambda x: (t2j.jit(g)(x),)) == run("cpu", lambda x: (g(x),)) == [12.0, 18.0, 24.0]


def test_a_view_of_a_returned_grad_is_its_view():
    # backward makes a Linear's weight gradient as a transposed view of a buffer inside the trace;
    # the call returns the .grad itself, and its row as a view of it, as torch does
    def step(x, m, opt):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
        g = m.weight.grad
        return g, g[1], g[:, 1:]

    def run(device, f):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.arange(8.0, device=device).reshape(2, 4)
        out = []
        for _ in range(3):  # the first trace, a second one (the grads exist now), the cached program
            g, row, cols = f(x, m, opt)
            out.append([g is m.weight.grad, row._base is g, cols._base is g, row.stride(), cols.stride(),
                        row.storage_offset(), cols.storage_offset(), cols.cpu().mul(1e4).round().tolist()])
            g.mul_(0)
            out.append(cols.cpu().tolist())
        return out

    expected = run("cpu", step)
    assert expected[0][:3] == [True, True, True]
    assert run("jax", t2j.jit(step)) == expected


def test_grads_kept_from_earlier_steps_keep_their_values():
    # zero_grad() and backward() give each step new .grad tensors in torch: a reference kept from
    # one step (a history of gradients, a returned .grad) is not changed by the next
    def run(device, jit):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
            return m.bias.grad

        f = t2j.jit(step) if jit else step
        kept, returned = [], []
        for i in range(5):
            returned.append(f(torch.full((4, 3), float(i + 1), device=device)))
            kept.append(m.weight.grad)
        return [g.cpu() for g in kept + returned], len({id(g) for g in kept})

    (expected, distinct), (actual, ours) = run("cpu", False), run("jax", True)
    assert ours == distinct == 5
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_grads_nobody_keeps_are_written_in_place():
    # (the per-call cost: a .grad no one else holds takes the next step's values)
    m = torch.nn.Linear(3, 2).to("jax")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    @t2j.jit
    def step(x):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()

    ids = []
    for _ in range(5):
        step(torch.ones(2, 3, device="jax"))
        ids.append(id(m.weight.grad))
    assert len(set(ids[1:])) == 1


@pytest.mark.parametrize("mode", [False, True])
def test_grad_mode_the_function_sets_stays_set_after_every_call(mode):
    def f(x):
        torch.set_grad_enabled(mode)
        return x * 2

    def run(device, fn):
        x = torch.ones(2, device=device, requires_grad=True)
        seen = []
        try:
            for _ in range(3):  # the trace, then the compiled program
                torch.set_grad_enabled(not mode)
                y = fn(x)
                seen.append((torch.is_grad_enabled(), y.requires_grad))
        finally:
            torch.set_grad_enabled(True)
        return seen

    assert run("jax", t2j.jit(f)) == run("cpu", f)


def test_lists_of_numbers_the_function_changes_change_on_every_call():
    # a loss history (appended to, its length never read: one program), a window kept to its last
    # two values (its length read: a program per length), a log of plain values, a rotation
    def make():
        history, window, log, ring = [], [], [], [1.5, 2.5, 3.5]

        def step(x):
            y = (x * 2).sum()
            history.append(y.item())
            window.append(y.item())
            if len(window) > 2:
                window.pop(0)
            log.append("step")
            ring.append(ring.pop(0))
            return y

        return step, (history, window, log, ring)

    expected_fn, expected = make()
    fn, lists = make()
    jitted = t2j.jit(fn)
    for i in range(10):
        expected_fn(torch.full((2,), float(i)))
        jitted(torch.full((2,), float(i), device="jax"))
        assert lists == expected
        if i == 5:
            traces = jitted.stats["traces"]
    assert jitted.stats["traces"] == traces  # (one program per window length, numbers it moves as inputs)


class _ReplayMemory:
    def __init__(self, container):
        self.memory = container

    def push(self, item):
        self.memory.append(item)

    def __len__(self):
        return len(self.memory)


@pytest.mark.parametrize("container", ["deque", "dict", "list"])
def test_a_step_that_returns_early_while_its_memory_is_short(container):
    # DQN's `if len(memory) < BATCH_SIZE: return`: the first (short) call's program must not be reused
    def run(device, jit):
        torch.manual_seed(0)
        net = nn.Linear(2, 1).to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        memory = _ReplayMemory({"deque": collections.deque(maxlen=4), "dict": {}, "list": []}[container])
        x = torch.ones(1, 2, device=device)

        def optimize():
            if len(memory) < 3:
                return None
            opt.zero_grad()
            loss = net(x).pow(2).sum()
            loss.backward()
            opt.step()
            return loss

        f = t2j.jit(optimize) if jit else optimize
        out = []
        for i in range(6):
            if container == "dict":
                memory.memory[i] = i
            else:
                memory.push(i)
            loss = f()
            out.append(None if loss is None else loss.item())
        return out, getattr(f, "stats", None)

    (want, _), (got, stats) = run("cpu", False), run("jax", True)
    assert got == pytest.approx(want, rel=1e-5)
    # a program per length read: 1, 2, 3 (the first step), 4; the deque keeps 4 items from then on
    assert stats["traces"] == (4 if container == "deque" else 6)


def test_torch_tensor_of_traced_tensors_stays_in_the_program():
    # actor-critic's torch.tensor([R]) of an element R of a tensor of returns; dtypes as torch infers them
    def f(v, device):
        returns = torch.tensor([3.0, 1.0, 2.0], device=device)
        returns = (returns - returns.mean()) / (returns.std() + 1e-6)
        a = torch.cat([torch.tensor([r], device=device) * (r - v) for r in returns])
        return (a, torch.tensor([v.to(torch.int32), 2], device=device), torch.tensor([[v, v.double()]], device=device),
                torch.tensor([v.bool(), True], device=device), torch.tensor([v, 1j], device=device))

    v = torch.tensor(0.5)
    got = t2j.jit(lambda v: f(v, "jax"), fullgraph=True)(v.to("jax"))
    for g, w in zip(got, f(v, "cpu")):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.cpu(), w)


def test_a_backward_into_history_made_before_the_call_runs_eagerly():
    # REINFORCE's finish_episode: the log-probs were saved during the episode, the jitted function
    # backwards through them; the trace stopped after running (and freeing) their graph
    def run(device, jit):
        torch.manual_seed(0)
        policy = nn.Linear(4, 2).to(device)
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        saved = []

        def finish():
            loss = torch.cat(saved).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            saved.clear()
            return loss.detach()

        f = t2j.jit(finish) if jit else finish
        x = torch.randn(6, 4)
        losses = []
        for episode in range(2):
            for t in range(3):
                saved.append(policy(x[3 * episode + t:3 * episode + t + 1].to(device)).log_softmax(-1)[:, 0])
            losses.append(f().item())
        return losses, policy.weight.detach().cpu()

    want = run("cpu", False)
    with pytest.warns(UserWarning, match="computed before the call"):
        got = run("jax", True)
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    torch.testing.assert_close(got[1], want[1])


def test_item_inside_becomes_traced_scalar():
    f = t2j.jit(lambda x, s: x * s.item())
    assert f(torch.ones(2, device="jax"), torch.tensor(3.0, device="jax")).tolist() == [3.0, 3.0]
    # a new value of s is an input, not a constant of the program
    assert f(torch.ones(2, device="jax"), torch.tensor(4.0, device="jax")).tolist() == [4.0, 4.0]
    assert f.stats["traces"] == 1


def test_data_dependent_python_control_flow_raises_with_fullgraph():
    f = t2j.jit(lambda x: x * 2 if x.sum() > 0 else x, fullgraph=True)
    with pytest.raises(RuntimeError, match="Python control flow"):
        f(torch.ones(2, device="jax"))


@pytest.mark.parametrize("fn", [
    lambda x: x * 2 if x.sum() > 0 else -x,
    lambda x: x[x > 0].sum() + torch.nonzero(x).shape[0],
    lambda x: torch.unique(x.round(), return_counts=True),
    lambda x: x.tolist(),
], ids=["python_if", "mask_nonzero", "unique", "tolist"])
def test_value_dependent_functions_run_eagerly_with_one_warning(fn):
    x = torch.randn(6, generator=torch.Generator().manual_seed(0))
    f = t2j.jit(fn)
    with pytest.warns(UserWarning, match="runs eagerly") as record:
        results = [f(x.to("jax")), f(-x.to("jax"))]
    assert sum("runs eagerly" in str(w.message) for w in record) == 1
    for got, expected in zip(results, [fn(x), fn(-x)]):
        if isinstance(expected, list):
            assert got == expected
        else:
            for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
                torch.testing.assert_close(a.cpu(), b)
    assert f.stats["traces"] == 1 and f.stats["eager_calls"] == 2
    assert any("runs eagerly" in m for m in t2j.explain_recompiles())


def test_eager_fallback_of_a_train_step_matches_torch():
    def run(device, jit):
        torch.manual_seed(0)
        model = nn.Linear(4, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            if loss > 0.01:  # Python control flow on a value: a graph break
                opt.step()
            return loss

        step = t2j.jit(step) if jit else step
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [step(x).item() for _ in range(4)]

    assert run("jax", True) == pytest.approx(run("cpu", False), rel=1e-5)


def test_failed_trace_leaves_no_tracer_behind():
    # the function's own error is raised as torch raises it: after the ops before it
    def make(device):
        torch.manual_seed(0)
        lin = nn.Linear(2, 2).to(device)
        opt = torch.optim.Adam(lin.parameters())

        def bad(x):
            opt.zero_grad()
            lin(x).sum().backward()
            opt.step()
            raise ValueError("boom")

        return lin, opt, t2j.jit(bad) if device == "jax" else bad

    (lin, opt, bad), (cpu_lin, _, cpu_bad) = make("jax"), make("cpu")
    for f, device in ((bad, "jax"), (cpu_bad, "cpu")):
        with pytest.raises(ValueError, match="boom"):
            f(torch.ones(1, 2, device=device))
    assert bad.stats["eager_calls"] == 1
    torch.testing.assert_close(lin.weight.detach().cpu(), cpu_lin.weight.detach())
    torch.testing.assert_close(lin.weight.grad.cpu(), cpu_lin.weight.grad)
    assert not isinstance(opt.state[lin.weight]["exp_avg"].jax(), jax.core.Tracer)
    lin(torch.ones(1, 2, device="jax")).sum().backward()  # still usable eagerly
    opt.step()
    assert lin.weight.grad.jax().shape == (2, 2)


def test_an_error_only_the_trace_raises_runs_eagerly_with_a_warning():
    calls = itertools.count()  # (a counter the cache key does not hold)

    def f(x):
        if next(calls) == 0:
            raise ValueError("only while tracing")
        return x * 2

    run = t2j.jit(f)
    with pytest.warns(UserWarning, match="trace raised ValueError: only while tracing, which the eager run does not"):
        assert run(torch.ones(2, device="jax")).tolist() == [2.0, 2.0]
    assert run(torch.ones(2, device="jax")).tolist() == [2.0, 2.0]
    assert run.stats["eager_calls"] == 2 and run.stats["traces"] == 1


def test_a_value_error_the_function_catches_still_runs_it_eagerly():
    # ``int(t.item())`` needs the value: the trace stops even where the function catches the error,
    # else the program would take the except branch, which torch does not
    def step(x):
        try:
            n = int(x.sum().item())
        except RuntimeError:
            n = 0
        return x * n

    run = t2j.jit(step)
    with pytest.warns(UserWarning, match="runs eagerly"):
        assert run(torch.ones(2, device="jax")).tolist() == [2.0, 2.0]
    assert run(torch.ones(3, device="jax")).tolist() == [3.0, 3.0, 3.0]


def test_a_packed_sequence_argument():
    # its batch sizes stay on the CPU (torch wants them there), their values part of the cache key
    from torch.nn.utils.rnn import pack_padded_sequence

    torch.manual_seed(0)
    gru = nn.GRU(2, 3, batch_first=True).to("jax")
    run = t2j.jit(lambda p: gru(p)[1])
    x = torch.randn(3, 4, 2, device="jax")
    for lengths in ([4, 2, 1], [3, 3, 2], [4, 2, 1]):
        packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True)
        torch.testing.assert_close(run(packed).cpu(), gru(packed)[1].cpu())
    assert run.stats["traces"] == 2


def test_an_error_part_way_leaves_torch_s_effects():
    def run(device):
        buf = torch.zeros(4, 3, device=device)

        def step(x):
            torch.mul(x, 2, out=buf)
            torch.add(buf, 1, out=buf[:2])  # overlaps its input: torch refuses
            return buf.sum()

        f = t2j.jit(step) if device == "jax" else step
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            f(torch.ones(4, 3, device=device))
        return buf.cpu()

    torch.testing.assert_close(run("jax"), run("cpu"))


_SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.1, total_steps=20),
    # (its step() never counts _step_count)
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 2, eta_min=1e-3),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
        torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 3), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)], [3]),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5,
                                                                              threshold=0.5),
}


@pytest.mark.parametrize("name", list(_SCHEDULERS))
def test_a_scheduler_stepping_inside_the_step_runs_after_each_program(name):
    torch.manual_seed(0)
    model, x = nn.Linear(4, 2), torch.randn(8, 4)

    def make_step(m, inputs):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        sched = _SCHEDULERS[name](opt)

        def step():
            before = sched.get_last_lr()[0], sched.last_epoch
            opt.zero_grad()
            loss = m(inputs).pow(2).mean()
            loss.backward()
            opt.step()
            sched.step(*([loss] if name == "ReduceLROnPlateau" else []))
            # (read after the step: the lr it set, which a jitted call sets after its program)
            return loss, before, opt.param_groups[0]["lr"], sched.get_last_lr()

        return step, opt

    (step, opt), (jitted, opt_j) = make_step(model, x), make_step(copy.deepcopy(model).to("jax"), x.to("jax"))
    jitted = t2j.jit(jitted, fullgraph=True)
    for _ in range(8):
        (loss_j, *lrs_j), (loss, *lrs) = jitted(), step()
        torch.testing.assert_close(loss_j.cpu(), loss)
        assert lrs_j == lrs
        assert opt_j.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert jitted.stats["traces"] == 2, t2j.explain_recompiles()


def _step_reading_the_stepped_lr(device, read):
    """A training step of SGD with StepLR that steps its scheduler inside and returns ``read(opt, sched)``."""
    lin = nn.Linear(2, 2).to(device)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

    def step(x):
        opt.zero_grad()
        lin(x).sum().backward()
        opt.step()
        sched.step()
        return read(opt, sched)

    return step


def test_arithmetic_on_the_lr_a_scheduler_step_set_in_the_step_runs_eagerly():
    # (the scheduler steps on the host after a compiled call's program, which cannot compute with its lr)
    def make_step(device):
        return _step_reading_the_stepped_lr(device, lambda opt, sched: opt.param_groups[0]["lr"] * 2)

    step, jitted = make_step("cpu"), t2j.jit(make_step("jax"))
    with pytest.warns(UserWarning, match="lr read after scheduler.step"):
        out = jitted(torch.ones(1, 2, device="jax"))
    assert out == step(torch.ones(1, 2)) == 0.1
    with pytest.raises(t2j.OpError, match=r"aten.mul.Tensor of a param group's lr read after scheduler.step"):
        t2j.jit(make_step("jax"), fullgraph=True)(torch.ones(1, 2, device="jax"))


@pytest.mark.parametrize("make", [lambda opt, sched: torch.tensor(opt.param_groups[0]["lr"], device="jax"),
                                  lambda opt, sched: torch.as_tensor(sched.get_last_lr(), device="jax")])
def test_a_tensor_of_the_lr_a_scheduler_step_set_in_the_step_is_the_stepped_lr(make):
    # (torch.tensor / as_tensor read the arrays of the tensors among their data without an op: the stand-in's
    # held the lr before the step, a number one step behind)
    step = _step_reading_the_stepped_lr("jax", make)
    with pytest.warns(UserWarning, match="lr read after scheduler.step"):
        lrs = [t2j.jit(step)(torch.ones(1, 2, device="jax")).cpu().reshape(()) for _ in range(2)]
    assert lrs == [torch.tensor(0.05), torch.tensor(0.025)]


@pytest.mark.parametrize("optimizer, key", [(torch.optim.SGD, "momentum"), (torch.optim.Adam, "betas")])
def test_the_momentum_a_scheduler_step_cycled_in_the_step_is_the_stepped_one(optimizer, key):
    # (OneCycleLR steps on the host after the program: read after its step() inside, the momentum was the one before)
    def make_step(device):
        torch.manual_seed(0)
        lin = nn.Linear(2, 1).to(device)
        opt = optimizer(lin.parameters(), lr=0.1, **({"momentum": 0.9} if key == "momentum" else {}))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10)

        def step(x):
            opt.zero_grad()
            lin(x).sum().backward()
            opt.step()
            sched.step()
            return opt.param_groups[0][key]

        return step

    step, jitted = make_step("cpu"), t2j.jit(make_step("jax"))
    with pytest.warns(UserWarning, match="lr read after scheduler.step"):
        got = [jitted(torch.ones(1, 2, device="jax")) for _ in range(3)]
    assert got == [step(torch.ones(1, 2)) for _ in range(3)]


def test_a_scheduler_stepping_before_the_optimizer_in_the_step_runs_eagerly():
    def make_step(device):
        lin = nn.Linear(2, 2).to(device)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)

        def step(x):
            opt.zero_grad()
            lin(x).sum().backward()
            sched.step()
            opt.step()

        return step, opt

    (step, opt), (jitted, opt_j) = make_step("cpu"), make_step("jax")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own, of a scheduler stepped before the optimizer)
        step(torch.ones(1, 2))
    with pytest.warns(UserWarning, match="steps an LR scheduler before an optimizer step"):
        t2j.jit(jitted)(torch.ones(1, 2, device="jax"))
    assert opt_j.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.05


def test_outputs_structure_and_cpu_inputs():
    f = t2j.jit(lambda x, n: {"sum": x.sum(), "parts": (x[:n], None, "tag")})
    out = f(torch.arange(6.0), 2)
    assert out["sum"].device.type == "jax" and out["sum"].item() == 15.0
    assert out["parts"][0].tolist() == [0.0, 1.0] and out["parts"][1:] == (None, "tag")


def test_objects_it_makes_and_returns_are_new_objects_with_each_calls_values():
    @dataclasses.dataclass(frozen=True)
    class Out:
        loss: torch.Tensor
        extra: dict

    class Stats:
        def __init__(self, peak, total):
            self.peak, self.total, self.tag = peak, total, "s"

    holder = types.SimpleNamespace(last=None)

    @t2j.jit
    def step(x):
        holder.last = x + 1
        return Out(x * 2, {"stats": [Stats(x.max(), x.sum().item())]}), holder

    outs = [step(torch.full((2,), float(i), device="jax")) for i in range(3)]
    assert len({id(o) for o, _ in outs}) == 3 and all(h is holder for _, h in outs)  # (an object it reached is itself)
    for i, (o, _) in enumerate(outs):
        stats = o.extra["stats"][0]
        assert o.loss.tolist() == [2.0 * i] * 2 and stats.peak.item() == i and stats.total == 2.0 * i
        assert stats.tag == "s"


def test_an_object_it_returns_in_several_places_is_one_object_after_each_call():
    class Out:
        pass

    @t2j.jit
    def step(x):
        r = Out()
        r.y = x * 2
        return r, r, [r], {"r": r}

    for i in range(2):
        a, b, (c,), d = step(torch.full((2,), float(i), device="jax"))
        assert a is b and a is c and a is d["r"] and a.y.tolist() == [2.0 * i] * 2


def test_method_of_a_module_subclass():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        @t2j.jit
        def forward(self, x):
            return self.lin(x).relu()

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 3)
    expected = net.lin(x).relu()
    net.to("jax")
    torch.testing.assert_close(net(x.to("jax")).cpu(), expected)


def test_function_returning_nothing_or_an_empty_tuple():
    lin = nn.Linear(2, 2).to("jax")

    @t2j.jit
    def zero_weights():
        with torch.no_grad():
            lin.weight.zero_()
        return ()

    assert zero_weights() == ()
    assert lin.weight.abs().sum().item() == 0.0


def test_python_numbers_a_trace_changes_are_program_outputs():
    # a cached call runs only the tensor program: a counter the function advances becomes a program
    # input whose new value is an output, stored back after every call (one extra trace finds it)
    class Trainer:
        def __init__(self):
            self.calls = 0
            self.lin = nn.Linear(3, 2).to("jax")

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def forward(self, x):
            self.seen += x.shape[0]
            return x

    trainer, counting, total = Trainer(), Counting().to("jax"), {"loss": 0.0}

    @t2j.jit
    def step(x):
        trainer.calls += 1
        loss = trainer.lin(counting(x)).sum()
        total["loss"] += loss.item()  # a traced number, accumulated in the program
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        losses = [step(torch.full((4, 3), i + 0.1, device="jax")).item() for i in range(3)]
    assert trainer.calls == 3 and counting.seen == 12
    assert total["loss"] == pytest.approx(sum(losses), rel=1e-12)  # Python floats: double precision
    assert step.stats["hits"] == 2


def test_python_state_changed_by_a_trace_is_reported():
    class Trainer:
        def __init__(self):
            self.phase = "warmup"
            self.lin = nn.Linear(3, 2).to("jax")

    trainer = Trainer()

    @t2j.jit
    def step(x):
        trainer.phase = "main"  # not a number: cached calls cannot repeat it
        return trainer.lin(x).sum()

    with pytest.warns(UserWarning, match=r"changed Python attributes \(Trainer.phase\)"):
        step(torch.ones(4, 3, device="jax"))


def test_containers_changed_by_a_trace_are_reported():
    counts, losses = [], []

    @t2j.jit
    def step(x):
        counts.append(1)
        return x * 2

    step(torch.ones(2, device="jax"))
    step(torch.ones(2, device="jax"))
    assert counts == [1, 1]  # (a list of plain values: each call makes its change)

    @t2j.jit
    def logged(x):
        losses.append(x.sum())
        return x

    with pytest.warns(UserWarning, match="every call traces and compiles again"):
        logged(torch.ones(2, device="jax"))
    assert losses[0].item() == 2.0


def test_tensors_created_in_a_trace_are_not_python_state():
    # lazily created tensor attributes (a GradScaler's scale) are program outputs, not bookkeeping
    lin = nn.Linear(3, 2).to("jax")
    scaler = torch.amp.GradScaler("jax", init_scale=4.0)

    @t2j.jit
    def step(x):
        loss = lin(x).sum()
        scaler.scale(loss).backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        step(torch.ones(4, 3, device="jax"))
    torch.testing.assert_close(lin.bias.grad.cpu(), torch.full((2,), 16.0))
    assert scaler.get_scale() == 4.0


def test_float64_learning_rate_keeps_its_digits():
    torch.manual_seed(0)
    ref = nn.Linear(4, 2).double()
    model = copy.deepcopy(ref).to("jax")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    sched = torch.optim.lr_scheduler.ExponentialLR(opts[1], gamma=0.9)

    def step(m, opt, x):
        opt.zero_grad()
        loss = m(x).pow(2).sum()
        loss.backward()
        opt.step()
        return loss

    jitted = t2j.jit(step)
    x = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(10):
        expected = step(ref, opts[0], x)
        got = jitted(model, opts[1], x.to("jax"))
        opts[0].param_groups[0]["lr"] *= 0.9
        sched.step()
        torch.testing.assert_close(got.cpu(), expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.weight.detach().cpu(), ref.weight.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("decay", ["in place", "assigned"])
def test_a_learning_rate_the_step_decays_itself_is_stored_after_each_call(dtype, decay):
    torch.manual_seed(0)
    ref = nn.Linear(4, 2).to(dtype)
    model = copy.deepcopy(ref).to("jax")
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (ref, model)]

    def step(m, opt, x):
        opt.zero_grad()
        loss = m(x).pow(2).sum()
        loss.backward()
        opt.step()
        for group in opt.param_groups:
            if decay == "in place":
                group["lr"] *= 0.9
            else:
                group["lr"] = group["lr"] * 0.5 + 0.01
        return loss

    jitted = t2j.jit(step)
    x = torch.randn(8, 4, dtype=dtype)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for _ in range(4):
        expected = step(ref, opts[0], x)
        torch.testing.assert_close(jitted(model, opts[1], x.to("jax")).cpu(), expected.detach(), **tol)
        lr = opts[1].param_groups[0]["lr"]
        assert type(lr) is float and lr == pytest.approx(opts[0].param_groups[0]["lr"], rel=tol["rtol"])
    torch.testing.assert_close(model.weight.detach().cpu(), ref.weight.detach(), **tol)
    assert jitted.stats["compiles"] <= 2


@pytest.mark.parametrize("make_copy", [
    lambda p: copy.deepcopy(p.detach()),
    lambda p: p.detach().to(p.dtype, copy=True),
    lambda p: torch.alias_copy(p.detach()),
    lambda p: torch.view_copy(p.detach(), p.shape),
], ids=["deepcopy", "to_copy", "alias_copy", "view_copy"])
def test_copies_survive_the_donation_of_their_source(make_copy):
    model = nn.Linear(3, 2).to("jax")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copies = [make_copy(p) for p in model.parameters()]
    before = [c.cpu().clone() for c in copies]

    @t2j.jit
    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    for _ in range(2):
        step(torch.ones(4, 3, device="jax"))
    for c, b in zip(copies, before):
        assert torch.equal(c.cpu(), b)  # still alive and unchanged: the step donated only the parameters' buffers


def test_sparse_csr_argument_is_refused_clearly():
    csr = torch.eye(3).to_sparse_csr()
    with pytest.raises(t2j.JitError, match="sparse_csr tensor; t2j.jit takes dense"):
        t2j.jit(lambda a: a * 2)(csr)


def test_lower_for_places_the_program_on_the_target_without_running_it():
    import jax

    model = _model().to("jax")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = t2j.jit(_classifier_step(model, opt))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    before = [p.detach().cpu().clone() for p in model.parameters()]
    device = jax.devices()[-1]
    lowered = step.lower_for(device, x, y)
    compiled = lowered.compile()
    here = step.lower(x, y).compile().memory_analysis()
    assert compiled.memory_analysis().argument_size_in_bytes == here.argument_size_in_bytes > 0
    assert {d for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set} == {device}
    step.lower_for(jax.sharding.SingleDeviceSharding(device), x, y)
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach().cpu(), b, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    with pytest.raises(t2j.JitError, match="lower_for expects a jax.Device or jax.sharding.Sharding"):
        step.lower_for("tpu", x, y)


def test_cached_call_after_lower_skips_the_state_walk(monkeypatch):
    """`lower` puts the optimizer's state dicts back as they were (the same dicts, with the same items): the
    calls after it find the cached program without walking the state again (as before the lowering)."""
    jit_module = importlib.import_module("torch2jax.jit")
    model = _model().to("jax")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = t2j.jit(_classifier_step(model, opt))
    x, y = torch.randn(16, 8, device="jax"), torch.randint(0, 4, (16,), device="jax")
    for _ in range(3):
        step(x, y)
    walks = []
    roots = jit_module._Walk.roots
    monkeypatch.setattr(jit_module._Walk, "roots", lambda self, r: walks.append(1) or roots(self, r))
    step(x, y)
    assert not walks
    step.lower(x, y)
    walks.clear()
    for _ in range(3):
        step(x, y)
    assert not walks
    assert step.stats["traces"] == 2


@pytest.mark.parametrize("container", [list, collections.deque])
def test_tensor_kept_by_a_hook_during_a_stopped_trace_says_what_happened(container):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1)).to("jax")
    kept = container()
    model[0].register_forward_hook(lambda module, args, out: kept.append(out.detach()))

    def f(x):
        y = model(x)
        if y.sum().item() > -1e9:  # the trace stops here; the call runs eagerly
            y = y * 2
        return y

    x = torch.randn(2, 3, device="jax")
    with pytest.warns(UserWarning, match="runs eagerly"):
        t2j.jit(f)(x)
    if container is list:  # a list the hook closes over is put back as it was: only the eager call's tensor
        (eager,) = kept
    else:  # a container t2j.jit does not watch keeps the trace's placeholder, which says what it is
        traced, eager = kept
        with pytest.raises(t2j.OpError, match="placeholder of a t2j.jit or jax.jit trace, kept outside it by a hook"):
            traced.sum()
    torch.testing.assert_close(eager.cpu(), model[0](x).detach().cpu())


def test_side_effects_of_hooks_and_module_lists_repeat_on_every_call():
    # a forward hook appending to a list it closes over, a module appending to its own list, a
    # function appending while it advances a counter: each call appends its own tensor, as in
    # eager (a list that grows is new state: every call traces again, with a warning)
    feats, counter = [], {"n": 0}

    class Keeper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.maps = nn.Linear(2, 2), []

        def forward(self, x):
            self.maps.append(x + 1)
            return self.lin(x)

    model = Keeper().to("jax")
    model.lin.register_forward_hook(lambda module, args, out: feats.append(out.detach()))

    def f(x):
        counter["n"] += 1
        return model(x) * 2

    run = t2j.jit(f)
    inputs = [torch.full((1, 2), float(k), device="jax") for k in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in inputs:
            run(x)
    assert counter["n"] == 3
    assert [m.tolist() for m in model.maps] == [(x + 1).tolist() for x in inputs]
    assert len(feats) == len(inputs)
    for out, x in zip(feats, inputs):
        torch.testing.assert_close(out.cpu(), model.lin(x).detach().cpu())


def _shift_rows(x):
    x[1:] = x[:-1] + 1
    return x[:, 0] * 1, x[2]


def _shift_rows_clone(x):
    x[1:] = x[:-1].clone()
    x[0] += 0
    return x


def _shift_block(x):
    x[0, 1:] = x[0, :-1] * 2  # a box inside the first row block
    return x[0], x.sum(1)


@pytest.mark.parametrize("fn", [_shift_rows, _shift_rows_clone, _shift_block])
@pytest.mark.parametrize("make", [lambda d: torch.arange(12.0, device=d).view(3, 4),
                                  lambda d: torch.arange(24.0, device=d).reshape(3, 2, 4) + 0,
                                  lambda d: torch.arange(64.0 * 128, device=d).view(64, 128)],
                         ids=["flat storage", "3-d storage", "64x128"])
def test_writes_of_rows_computed_from_shifted_rows(fn, make):
    """A write of rows computed from other rows of the same tensor (a rolling buffer) reads the old
    rows: XLA's CPU compiler got this wrong for an update of a reshaped storage (openxla/xla#49176),
    so a contiguous view is written as one box of the storage in its own shape."""
    want = fn(make("cpu"))
    got = t2j.jit(fn)(make("jax"))
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_input_validation_in_library_code_runs_with_the_program():
    """gaussian_nll_loss's ``if torch.any(var < 0): raise`` and clip_grad_norm_'s non-finite check
    do not stop the trace: they are checked when the program runs, raising torch's error type."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 2), None]
    models[1] = copy.deepcopy(models[0]).to("jax")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]

    def step(model, opt, x, t, var):
        opt.zero_grad()
        loss = F.gaussian_nll_loss(model(x), t, var)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        return loss

    jitted = t2j.jit(step, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, t, var = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen), torch.rand(8, 2, generator=gen)
        expected = step(models[0], opts[0], x, t, var)
        torch.testing.assert_close(jitted(models[1], opts[1], x, t, var).cpu(), expected)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach())
    for fn, model, opt in ((step, models[0], opts[0]), (jitted, models[1], opts[1])):
        with pytest.raises(ValueError, match="var has negative entry"):
            fn(model, opt, x, t, -var)
        with pytest.raises(RuntimeError, match="non-finite"):
            fn(model, opt, torch.full_like(x, float("inf")), t, var)
    # a failed check leaves the state as torch's raise does: training goes on from the same place
    torch.testing.assert_close(jitted(models[1], opts[1], x, t, var).cpu(), step(models[0], opts[0], x, t, var))
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach())
    assert jitted.stats["eager_calls"] == 0


def test_a_failed_check_in_the_program_leaves_torch_s_effects_before_it():
    # clip_grad_norm_ finds the gradients non-finite after backward wrote them: torch raises with
    # them written; the call runs again eagerly and raises there
    def run(device, wrap):
        torch.manual_seed(0)
        model = nn.Linear(3, 1).to(device)
        seen = torch.zeros((), device=device)

        def step(x):
            seen.add_(1)
            model.zero_grad()
            model(x).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)

        f = wrap(step)
        f(torch.ones(2, 3, device=device))
        with pytest.raises(RuntimeError, match="non-finite"):
            f(torch.full((2, 3), float("inf"), device=device))
        return seen.item(), model.weight.grad.cpu().tolist()

    assert run("jax", t2j.jit) == run("cpu", lambda f: f)


def test_cpu_arguments_keep_64_bit_dtypes():
    big = torch.tensor([3, -5]) * 2**40
    wide = torch.tensor([1.0, 2.0], dtype=torch.float64)

    @t2j.jit
    def f(i, d):
        return i + 1, d + 1e-12, i.dtype, d.dtype

    i, d, idtype, ddtype = f(big, wide)
    assert (idtype, ddtype) == (torch.int64, torch.float64)
    torch.testing.assert_close(i.cpu(), big + 1, rtol=0, atol=0)
    torch.testing.assert_close(d.cpu(), wide + 1e-12, rtol=0, atol=0)


@pytest.mark.parametrize("indices", [torch.tensor([2, 5]), torch.tensor(3)], ids=["indices", "sections"])
def test_tensor_split_with_index_tensor(indices):
    """torch takes the indices of tensor_split as a CPU tensor; t2j.jit moves CPU arguments to
    the jax device, where they are read as torch reads them (a traced one breaks the graph)."""
    x = torch.arange(20.0).reshape(10, 2)
    expected = torch.tensor_split(x, indices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = t2j.jit(lambda x, i: torch.tensor_split(x, i))(x, indices)
    for pieces in (got, torch.tensor_split(x.to("jax"), indices.to("jax")), torch.tensor_split(x.to("jax"), indices)):
        assert len(pieces) == len(expected)
        for a, b in zip(pieces, expected):
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="tensor_split expected tensor_indices_or_sections to have dtype of long"):
        torch.tensor_split(x.to("jax"), indices.float())


def test_explain_recompiles_names_grad_mode_and_autocast():
    model = _model().to("jax")
    f = t2j.jit(lambda x: model(x))
    x = torch.randn(2, 8)
    f(x)
    with torch.no_grad():
        f(x)
    assert "grad mode: True -> False" in t2j.explain_recompiles()[-1]
    with torch.no_grad(), torch.autocast("jax", dtype=torch.bfloat16):
        f(x)
    assert "autocast (enabled, dtype): (False, torch.float16) -> (True, torch.bfloat16)" in t2j.explain_recompiles()[-1]


def test_state_reached_through_default_arguments_is_carried():
    model = _model().to("jax")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(x, y, model=model, opt=opt):
        return _classifier_step(model, opt)(x, y)

    jitted = t2j.jit(step)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    for _ in range(2):
        jitted(x, y)
        _classifier_step(reference, ref_opt)(x.to("jax"), y.to("jax"))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu())


def test_explain_recompiles_names_the_parameter_whose_optimizer_state_changed():
    model = _model().to("jax")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = t2j.jit(_classifier_step(model, opt))
    x, y = torch.randn(4, 8, device="jax"), torch.tensor([0, 1, 2, 3], device="jax")
    step(x, y)
    step(x, y)
    del opt.state[model[3].bias]["momentum_buffer"]
    step(x, y)
    assert step.stats["traces"] == 3
    assert ("optimizer #0 state of param_groups[0].params[5]['momentum_buffer']: <tensor> -> absent"
            in t2j.explain_recompiles()[-1])


def test_grads_set_between_calls_are_what_the_next_call_reads():
    """A cached call skips re-pointing a .grad that already holds the program's tensor;
    a .grad the user replaced in between is read, not the stale one."""

    def accumulate(model):
        def step(x):
            model(x).sum().backward()
        return step

    x = torch.randn(4, 8)
    ref = _model()
    model = _model().to("jax")
    step, ref_step = t2j.jit(accumulate(model)), accumulate(ref)
    for _ in range(3):
        step(x.to("jax"))
        ref_step(x)
    grad = model[0].weight.grad
    step(x.to("jax"))
    ref_step(x)
    assert model[0].weight.grad is grad  # the same tensor, holding the new value
    model[0].weight.grad = torch.ones_like(model[0].weight)
    ref[0].weight.grad = torch.ones_like(ref[0].weight)
    model[3].bias.grad = None
    ref[3].bias.grad = None
    step(x.to("jax"))
    ref_step(x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5)


def _replace_parameter(model, opt):
    model[3].bias = nn.Parameter(torch.full_like(model[3].bias, 0.5))
    opt.param_groups[0]["params"][-1] = model[3].bias


def _add_submodule(model, opt):
    model.append(nn.Identity())  # a new submodule (no state) changes the module tree only


def _add_buffer(model, opt):
    model[2].register_buffer("seen", torch.zeros(32, device=model[2].weight.device))


def _clear_state(model, opt):
    opt.state.clear()


def _reload_with_new_lr(model, opt):
    state = copy.deepcopy(opt.state_dict())  # load_state_dict replaces state and param_groups whole
    state["param_groups"][0]["lr"] = 0.05
    opt.load_state_dict(state)


def _replace_parameter_dict(model, opt):
    weight, bias = model[3].weight, model[3].bias  # a container replaced whole, not changed in place
    model[3]._parameters = {"weight": nn.Parameter(weight.detach() * 2), "bias": nn.Parameter(bias.detach() + 1)}


# between two cached calls, what a user may change: every change must reach the next call
BETWEEN_CALLS = {
    "eval": lambda model, opt: model.eval(),
    "weight_decay": lambda model, opt: opt.param_groups[0].update(weight_decay=0.5),
    "betas": lambda model, opt: opt.param_groups[0].update(betas=(0.5, 0.9)),
    "lr_as_new_float": lambda model, opt: opt.param_groups[0].update(lr=float("0.02")),
    "freeze": lambda model, opt: model[0].weight.requires_grad_(False),
    "grad_to_none": lambda model, opt: setattr(model[0].weight, "grad", None),
    "replace_parameter": _replace_parameter,
    "add_submodule": _add_submodule,
    "add_buffer": _add_buffer,
    "clear_optimizer_state": _clear_state,
    "load_optimizer_state_dict": _reload_with_new_lr,
    "replace_parameter_dict": _replace_parameter_dict,
    "add_param_group": lambda model, opt: opt.add_param_group(
        {"params": [nn.Parameter(torch.ones(3, device=model[0].weight.device))], "lr": 0.1}),
}


@pytest.mark.parametrize("change", list(BETWEEN_CALLS))
def test_state_changed_between_cached_calls_is_seen(change):
    def make(device):
        model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.0), nn.LayerNorm(32), nn.Linear(32, 4))
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p, std=0.3)
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y) + sum(b.sum() for b in model.buffers())
            loss.backward()
            opt.step()
            return loss

        return model, opt, step

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(6)]
    ref, ref_opt, ref_step = make("cpu")
    model, opt, step = make("jax")
    step = t2j.jit(step)
    for i, (x, y) in enumerate(data):
        if i == 3:
            BETWEEN_CALLS[change](ref, ref_opt)
            BETWEEN_CALLS[change](model, opt)
        torch.testing.assert_close(step(x.to("jax"), y.to("jax")).cpu(), ref_step(x, y).detach(),
                                   rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5, msg=n)


def test_captured_cpu_tensor_changed_in_place_is_read_again():
    scale = torch.tensor(1.0)
    f = t2j.jit(lambda x: x * scale)
    x = torch.ones(2, device="jax")
    for k in range(3):
        assert f(x).tolist() == [k + 1.0] * 2
        scale.fill_(k + 2.0)
    assert "captured CPU tensor #0" in t2j.explain_recompiles()[-1]


def test_captured_cpu_inference_tensor_is_guarded_by_its_bytes():
    """A CPU tensor made under torch.inference_mode has no version counter (reading it raised in
    the cache key); one changed in place inside another inference_mode block is read again."""
    with torch.inference_mode():
        scale = torch.tensor([1.0, 2.0])
        half = torch.ones(2, dtype=torch.bfloat16)
    f = t2j.jit(lambda x: x * scale.to(x.device) * half.to(x.device))
    x = torch.ones(2, device="jax")
    assert f(x).tolist() == [1.0, 2.0]
    assert f(x).tolist() == [1.0, 2.0]
    with torch.inference_mode():
        scale.mul_(10)
    assert f(x).tolist() == [10.0, 20.0]


def test_outputs_keep_torchs_strides():
    """A channels_last network's output is channels_last, as in eager (and differentiable)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()).to(memory_format=torch.channels_last)
    model = copy.deepcopy(ref).to("jax")
    x = torch.randn(2, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    want = ref(x)
    got = t2j.jit(model)(x.to("jax"))
    assert got.stride() == want.stride() != want.contiguous().stride()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(model[0].weight.grad.cpu(), ref[0].weight.grad, rtol=1e-4, atol=1e-4)
    transposed = t2j.jit(lambda a: (a * 2).t())(torch.ones(2, 3, device="jax"))
    assert transposed.stride() == (1, 3)


def test_modules_left_on_the_cpu():
    """A CPU copy the function can reach but does not use is not its state; one it uses is
    named in the error, also where the arguments are CPU tensors t2j.jit moves to the jax
    device; a submodule added after ``.to('jax')`` is named."""
    torch.manual_seed(0)
    ref = nn.Linear(3, 3)
    model = copy.deepcopy(ref).to("jax")
    x = torch.randn(2, 3)
    f = t2j.jit(lambda x: (model if x.device.type == "jax" else ref)(x))
    torch.testing.assert_close(f(x.to("jax")).cpu(), ref(x))
    for arg in (x.to("jax"), x):
        with pytest.raises(t2j.JitError, match="uses a Linear, whose parameters or buffers are on the CPU"):
            t2j.jit(lambda x: ref(x))(arg)
    seq = nn.Sequential(nn.Linear(3, 3)).to("jax")
    seq.append(nn.Linear(3, 2))
    with pytest.raises(t2j.JitError, match=r"Sequential\.1\.weight is a tensor on cpu, not on the jax device"):
        t2j.jit(lambda x: seq(x))(x.to("jax"))


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1), momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.99))),
], ids=["sgd", "adam"])
def test_tensor_learning_rate_on_the_cpu_follows_the_scheduler(make_opt):
    """torch.compile's advice, lr=torch.tensor(...): the scheduler's in-place update is an input
    of the program (no retrace), as a float lr is."""
    results = {}
    for device in ("cpu", "jax"):
        model = _model().to(device)
        opt = make_opt(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        step = _classifier_step(model, opt)
        if device == "jax":
            step = t2j.jit(step)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            step(x.to(device), y.to(device))
            sched.step()
        results[device] = [p.detach().cpu() for p in model.parameters()]
    assert step.stats["traces"] == 2  # the first call creates .grad and the optimizer state
    for a, e in zip(results["jax"], results["cpu"]):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_optimizer_step_alone_carries_the_parameters():
    model, ref = _model().to("jax"), _model()
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    step = t2j.jit(opt.step)
    x = torch.randn(4, 8)
    for _ in range(3):
        model(x.to("jax")).sum().backward()
        step()
        opt.zero_grad()
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)


def test_write_to_a_tensor_found_only_while_tracing():
    """A tensor too deep for the search of roots is found when the trace reads it; the
    tracer the first trace wrote into it is taken out again before the retrace."""

    class Holder:
        pass

    a = Holder()
    a.b = Holder()
    a.b.c = Holder()
    a.b.c.t = torch.zeros(3, device="jax")

    @t2j.jit
    def f(x):
        a.b.c.t.add_(x)
        return x * 2

    for _ in range(3):
        f(torch.ones(3, device="jax"))
    assert a.b.c.t.tolist() == [3.0] * 3


def test_optimizer_state_holding_lists_runs_eagerly():
    model = _model().to("jax")
    x = torch.randn(4, 8, device="jax")
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    step = t2j.jit(lambda: opt.step(closure))
    with pytest.warns(UserWarning, match="runs eagerly"):
        losses = [step().item() for _ in range(8)]
    assert losses[7] < losses[0]
    assert step.stats["eager_calls"] == 8
    # its state's shapes change on every call, each a new key whose trace stops again: after a
    # few in a row (one more where its Python counters, func_evals and n_iter, become inputs), new
    # keys run eagerly without a trace
    assert step.stats["traces"] == 5


def test_lbfgs_with_a_jitted_closure_that_runs_eagerly():
    # the closure's trace stops (a branch on the loss); LBFGS.step holds `state = self.state[p]` across its
    # calls of the closure, so the failed trace must put back that very dict, not a copy
    def run(device, jit):
        torch.manual_seed(0)
        m = nn.Linear(3, 1).double().to(device)
        x, y = torch.randn(8, 3, dtype=torch.double).to(device), torch.randn(8, 1, dtype=torch.double).to(device)
        opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4)

        def closure():
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            if loss > 100:
                loss = loss * 1
            loss.backward()
            return loss

        c = t2j.jit(closure) if jit else closure
        return [opt.step(c).item() for _ in range(3)], m.weight.detach().cpu()

    want = run("cpu", False)
    with pytest.warns(UserWarning, match="runs eagerly"):
        got = run("jax", True)
    assert got[0] == pytest.approx(want[0], rel=1e-12)
    torch.testing.assert_close(got[1], want[1])


def test_lbfgs_with_a_jitted_closure_compiles_it_once():
    # LBFGS's history (old_dirs, al...) grows between the closure's calls: state of the optimizer stepping,
    # not of its closure, which must not trace again for it
    def run(device, jit):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
        x, y = torch.randn(16, 4).to(device), torch.randn(16, 1).to(device)
        opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=5)

        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        c = t2j.jit(closure) if jit else closure
        return [opt.step(c).item() for _ in range(4)], m[0].weight.detach().cpu(), c

    want = run("cpu", False)
    *got, c = run("jax", True)
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-4)
    # (a second trace: the first call finds no gradients yet)
    assert c.stats["traces"] <= 2 and c.stats["hits"] >= 14, t2j.explain_recompiles()


@pytest.mark.parametrize("form", ["print", "format", "tensor"])
def test_printing_a_traced_value_runs_the_call_eagerly(form, capsys):
    # as a graph break under torch.compile: each call prints its own value (the trace printed a placeholder
    # once, and cached calls nothing)
    def f(x):
        loss = (x * 2).sum()
        if form == "print":
            print("loss:", loss.item())
        elif form == "format":
            print(f"loss: {loss.item():.3f}")
        else:
            print("loss:", loss)
        return loss

    jitted = t2j.jit(f)
    with pytest.warns(UserWarning, match="runs eagerly"):
        for i in range(3):
            jitted(torch.full((2,), float(i), device="jax"))
    printed = [line.replace(", device='jax:0'", "") for line in capsys.readouterr().out.splitlines()]
    for i in range(3):
        f(torch.full((2,), float(i)))
    assert printed == capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("case", ["set", "accumulate", "mask_2d", "inner_dim", "rows"])
def test_assignment_through_a_traced_mask_with_one_value_per_entry(case):
    # DQN's next_values[non_final] = target(non_final_states).max(1).values: x's shape, so one program
    def f(x, mask, v):
        x = x.clone()
        if case == "set":
            x[mask] = v
        elif case == "accumulate":
            x.index_put_((mask,), v, accumulate=True)
        elif case == "mask_2d":
            x[mask.view(2, 3)] = v
        elif case == "inner_dim":
            x[:, mask] = v
        else:
            x[mask] = v[:, None]
        return (x * torch.arange(1.0, x.numel() + 1, device=x.device).view(x.shape)).sum()

    mask = torch.tensor([True, False, True, True, False, True])
    v = torch.tensor([1.5, -2.0, 3.0, 4.5], requires_grad=True)
    x = torch.randn(*{"mask_2d": (2, 3), "inner_dim": (2, 6), "rows": (6, 3)}.get(case, (6,)), requires_grad=True)
    want = f(x, mask, v)
    want_grads = torch.autograd.grad(want, (x, v))
    xj, vj = (t.detach().to("jax").requires_grad_() for t in (x, v))
    got = t2j.jit(f, fullgraph=True)(xj, mask.to("jax"), vj)
    torch.testing.assert_close(got.cpu(), want)
    for g, w in zip(torch.autograd.grad(got, (xj, vj)), want_grads):
        torch.testing.assert_close(g.cpu(), w)


class _Keeps(nn.Module):
    """Keeps a list of tensors the training loop appends to (REINFORCE's saved log-probs); reads it once a
    flag is set."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.saved = []
        self.use = False

    def forward(self, x):
        y = self.lin(x)
        return y + sum(self.saved) if self.use else y


def test_a_list_of_tensors_a_module_keeps_is_read_as_it_is_now():
    def run(device, jit):
        torch.manual_seed(0)
        m = _Keeps().to(device)
        f = t2j.jit(m) if jit else m
        out = []
        for i in range(6):
            m.use = i >= 3
            y = f(torch.ones(1, 2, device=device))
            m.saved.append(y.detach() * 0 + i)
            out.append(y.sum().item())
        return out

    assert run("jax", True) == pytest.approx(run("cpu", False), rel=1e-6)


class _Policy(nn.Module):
    """REINFORCE's policy: the training loop appends each step's log-prob and reward to its lists."""

    def __init__(self, peek=False):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.saved_log_probs, self.rewards = [], []
        self.peek = peek

    def forward(self, x):
        probs = self.lin(x).softmax(-1)
        if self.peek and self.rewards:  # (a list read for its truth value only)
            probs = probs * 0.5 + 0.25
        return probs


@pytest.mark.parametrize("peek", [False, True], ids=["unread", "read"])
def test_lists_a_module_keeps_are_state_only_once_a_trace_reads_them(peek):
    # unread, the lists growing between calls would make each call a new program (REINFORCE's policy)
    def run(device, jit):
        torch.manual_seed(0)
        policy = _Policy(peek).to(device)
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        f = t2j.jit(policy) if jit else policy
        xs = torch.randn(3, 5, 1, 4)
        for episode in range(3):
            for t in range(5):
                probs = f(xs[episode, t].to(device))
                policy.saved_log_probs.append(probs[0, 0].log())
                policy.rewards.append(float(t))
            loss = -sum(lp * r for lp, r in zip(policy.saved_log_probs, policy.rewards))
            opt.zero_grad()
            loss.backward()
            opt.step()
            del policy.saved_log_probs[:], policy.rewards[:]
        return policy.lin.weight.detach().cpu(), f

    want, _ = run("cpu", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, f = run("jax", True)
    torch.testing.assert_close(got, want)
    # read for its truth value: one program while empty, one for every length after
    assert f.stats["traces"] == (6 if peek else 1), t2j.explain_recompiles()


@pytest.mark.parametrize("hook", ["register_hook", "post_accumulate_grad"])
def test_a_counter_a_gradient_hook_advances_advances_on_every_call(hook):
    def run(device, jit):
        w = torch.arange(3.0, device=device, requires_grad=True)
        calls = [0]

        def count(*_):
            calls[0] += 1

        getattr(w, "register_hook" if hook == "register_hook" else "register_post_accumulate_grad_hook")(count)

        def step(a):
            (w * a).sum().backward()

        s = t2j.jit(step) if jit else step
        for _ in range(4):
            s(torch.ones(3, device=device))
        return calls[0], w.grad.cpu()

    want = run("cpu", False)
    got = run("jax", True)
    assert got[0] == want[0] == 4
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("hook", ["module_forward", "module_full_backward", "step_pre", "global_step_post"])
def test_a_counter_a_global_module_hook_or_an_optimizer_step_hook_advances_advances_on_every_call(hook):
    # (a global module hook and an optimizer's step hooks were no roots: the counter they close over
    # advanced only while tracing, twice in four calls)
    from torch.nn.modules import module as module_hooks
    from torch.optim import optimizer as optimizer_hooks

    def run(device, jit):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 1).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        calls = [0]

        def count(*_):
            calls[0] += 1

        handle = {"module_forward": lambda: module_hooks.register_module_forward_hook(count),
                  "module_full_backward": lambda: module_hooks.register_module_full_backward_hook(count),
                  "step_pre": lambda: opt.register_step_pre_hook(count),
                  "global_step_post": lambda: optimizer_hooks.register_optimizer_step_post_hook(count)}[hook]()

        def step(x):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()

        s = t2j.jit(step) if jit else step
        try:
            for _ in range(4):
                s(torch.ones(2, 3, device=device))
        finally:
            handle.remove()
        return calls[0], m.weight.detach().cpu()

    want = run("cpu", False)
    got = run("jax", True)
    assert got[0] == want[0] == 4
    torch.testing.assert_close(got[1], want[1])


_FORWARD_CALLS = {"n": 0}  # advanced by `_CountingLoss.forward`
_FORWARD_LOG = [0]


class _CountingLoss(torch.nn.Module):
    def forward(self, a):
        _FORWARD_CALLS["n"] += 1
        _FORWARD_LOG[0] += 1
        return a.pow(2).mean()


def test_a_global_dict_or_list_a_module_forward_advances_advances_on_every_call():
    # (a module's forward read from globals only numbers, strings and functions: the dict and list it advances
    # were no state, advanced only while tracing)
    def run(device, jit):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 1).to(device)
        loss_fn = _CountingLoss()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        _FORWARD_CALLS["n"] = _FORWARD_LOG[0] = 0

        def step(x):
            opt.zero_grad()
            loss_fn(m(x)).backward()
            opt.step()

        s = t2j.jit(step) if jit else step
        for _ in range(4):
            s(torch.ones(2, 3, device=device))
        return _FORWARD_CALLS["n"], _FORWARD_LOG[0], m.weight.detach().cpu()

    want = run("cpu", False)
    got = run("jax", True)
    assert got[:2] == want[:2] == (4, 4)
    torch.testing.assert_close(got[2], want[2])


_REVERSAL = 1.0  # the gradient reversal's scale, set by the training loop (DANN's schedule)


class _GradReverse(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _GradReverse.calls += 1
        return -_REVERSAL * g


class _ReversedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(_GradReverse.apply(x))


@pytest.mark.parametrize("where", ["function", "forward"])
def test_a_global_and_a_class_counter_a_custom_function_reads_are_the_functions_own(where):
    # (a custom autograd.Function's methods were not walked: the global its backward reads was frozen into the
    # program, and its class counter advanced only while tracing)
    global _REVERSAL

    def run(device, jit):
        global _REVERSAL
        torch.manual_seed(0)
        feat, head = torch.nn.Linear(3, 3).to(device), _ReversedHead().to(device)
        opt = torch.optim.SGD([*feat.parameters(), *head.parameters()], lr=0.1)
        _GradReverse.calls = 0

        def step(x):
            opt.zero_grad()
            h = feat(x)
            out = head(h) if where == "forward" else _GradReverse.apply(h).sum(1, keepdim=True)
            out.sum().backward()
            opt.step()

        s = t2j.jit(step) if jit else step
        for i in range(4):
            _REVERSAL = 0.5 * i
            s(torch.ones(2, 3, device=device))
        return _GradReverse.calls, feat.weight.detach().cpu()

    try:
        want = run("cpu", False)
        got = run("jax", True)
    finally:
        _REVERSAL = 1.0
    assert got[0] == want[0] == 4
    torch.testing.assert_close(got[1], want[1])


class _BoostedSGD(torch.optim.Optimizer):
    """An optimizer of the user's whose step reads a plain attribute the training loop sets and advances a
    counter."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self.boost, self.steps = 1.0, 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * self.boost)


def test_an_optimizer_class_of_the_users_attributes_are_guarded_and_its_counters_advance():
    # (its attributes were no state: a new ``opt.boost`` kept the traced value, silently, and ``self.steps``
    # advanced only while tracing)
    def run(device, jit):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 1).to(device)
        opt = _BoostedSGD(m.parameters(), 0.1)

        def step(x):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()

        s = t2j.jit(step) if jit else step
        for i in range(4):
            opt.boost = 0.5 * i
            s(torch.ones(2, 3, device=device))
        return opt.steps, m.weight.detach().cpu()

    want = run("cpu", False)
    got = run("jax", True)
    assert got[0] == want[0] == 4
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("foreach", [None, False])
def test_adam_steps_a_parameter_listed_twice_twice(foreach):
    # (tied weights listed by named_parameters(remove_duplicate=False); torch warns but steps each entry)
    def run(device, jit):
        w = nn.Parameter(torch.tensor([1.0, -2.0], device=device))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = torch.optim.Adam([w, w], lr=0.1, foreach=foreach)

        def step():
            opt.zero_grad()
            (w * torch.tensor([1.0, 3.0], device=device)).sum().backward()
            opt.step()

        s = t2j.jit(step) if jit else step
        for _ in range(3):
            s()
        return w.detach().cpu()

    torch.testing.assert_close(run("jax", True), run("cpu", False))


def test_a_function_traced_again_on_every_call_warns_once():
    m = _Keeps().to("jax")
    m.use = True  # (its forward reads the list: a new length is a new program)
    f = t2j.jit(m)
    with pytest.warns(UserWarning, match="traced and compiled again on each of its last 8 calls") as record:
        for i in range(12):
            m.saved.append(f(torch.ones(1, 2, device="jax")).detach()[0, 0])
    assert sum("on each of its last" in str(w.message) for w in record) == 1


def test_python_min_and_max_of_traced_values_stay_in_the_program():
    def f(x):
        s = x.sum().item()
        scale = min(1.0, 1 / max(s, 1e-3))  # traced numbers
        norm = max(x.norm(), 1.5)  # a traced one-element tensor and a number: a tensor
        return x * scale, min([s, 2.0, 5.0]), max(i * i for i in range(3)), norm

    step = t2j.jit(f, fullgraph=True)
    for x in ([0.1, 0.2], [3.0, 4.0], [-2.0, 0.5]):  # each branch of each min / max, one program
        x = torch.tensor(x)
        got, want = step(x.to("jax")), f(x)
        torch.testing.assert_close(got[0].cpu(), want[0])
        assert got[1] == pytest.approx(want[1]) and got[2] == want[2]
        assert float(got[3]) == pytest.approx(float(want[3]))
    assert step.stats["traces"] == 1
    assert min(3, 1, 2) == 1 and max([], default=7) == 7  # (Python's own again outside the trace)


def test_an_optimizer_held_deeper_than_the_walk_is_found_by_its_step():
    class Holder:
        pass

    def run(jit):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).to("jax")
        trainer = Holder()
        trainer.state = Holder()
        trainer.state.inner = Holder()
        trainer.state.inner.opt = torch.optim.Adam(model.parameters(), lr=0.1)

        def step(x):
            opt = trainer.state.inner.opt
            opt.zero_grad()
            loss = model(x).pow(2).sum()
            loss.backward()
            opt.step()
            return loss

        f = t2j.jit(step) if jit else step
        losses = [f(torch.full((3, 4), i + 1.0, device="jax")).item() for i in range(4)]
        return losses, trainer.state.inner.opt.state[model.weight]["step"].item()

    (jitted, steps), (eager, eager_steps) = run(True), run(False)
    assert jitted == pytest.approx(eager, rel=1e-5) and steps == eager_steps == 4  # (its Adam state carried)


def test_a_flag_the_function_turns_takes_the_other_branch_on_the_next_call():
    class ActNorm(torch.nn.Module):  # data-dependent initialization on the first call
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))
            self.initialized = False

        def forward(self, x):
            if not self.initialized:
                with torch.no_grad():
                    self.scale.copy_(1 / x.std(0))
                self.initialized = True
            return x * self.scale

    class State:
        def __init__(self):
            self.first = True

    def make():
        state, config = State(), {"warm": False}
        norm = ActNorm()

        def f(x):
            y = norm(x)
            if state.first:
                state.first = False
                y = y * 100
            if not config["warm"]:
                config["warm"] = True
                y = y - 1
            return y

        return f, norm, lambda: (state.first, config["warm"], norm.initialized)

    xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    f, norm, flags = make()
    want = [f(x) for x in xs]
    g, jnorm, jflags = make()
    jnorm.to("jax")
    step = t2j.jit(g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning that cached calls would not change them)
        got = [step(x.to("jax")) for x in xs]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.detach().cpu(), b.detach())
    assert jflags() == flags() == (False, True, True)
    assert step.stats["traces"] == 2


def test_numbers_appended_to_a_list_are_appended_by_every_call():
    class Meter:
        def __init__(self):
            self.history = []

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, meter = [], Meter()

        def step(x):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            meter.history.append(2 * loss.item())
            return loss.detach()

        return model, step, losses, meter

    x = torch.randn(8, 4)
    _, step, losses, meter = make()
    for _ in range(3):
        step(x)
    model, jstep, jlosses, jmeter = make()
    model.to("jax")
    jitted = t2j.jit(jstep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            jitted(x.to("jax"))
    assert all(type(v) is float for v in jlosses + jmeter.history)
    assert jlosses == pytest.approx(losses, rel=1e-5) and jmeter.history == pytest.approx(meter.history, rel=1e-5)
    assert jitted.stats["traces"] == 2  # (the second: with .grad)


class _Counter:
    n = 0  # a class's default, which the first ``+=`` shadows on the instance


def _counter_cases():
    def list_item():
        c = [0]

        def f(x):
            c[0] += 1
            return x * c[0]
        return f, lambda: c[0]

    def new_dict_key():
        d = {}

        def f(x):
            d["n"] = d.get("n", 0) + 1
            return x * d["n"]
        return f, lambda: d["n"]

    def class_default():
        t = _Counter()

        def f(x):
            t.n += 1
            return x * t.n
        return f, lambda: t.n

    def math_of_a_counter():
        t = _Counter()

        def f(x):
            t.n += 1
            return x * math.exp(-t.n) + math.sqrt(t.n)
        return f, lambda: t.n

    def cpu_module_attribute():
        m = torch.nn.Linear(1, 1)  # (on the CPU: not state, but its Python attributes are read)
        m.calls = 0

        def f(x):
            m.calls += 1
            return x * m.calls
        return f, lambda: m.calls

    return [list_item, new_dict_key, class_default, math_of_a_counter, cpu_module_attribute]


@pytest.mark.parametrize("make", _counter_cases(), ids=lambda f: f.__name__)
def test_python_counters_the_function_advances_advance_on_every_call(make):
    f, count = make()
    want = [f(torch.ones(2))[0].item() for _ in range(4)], count()
    g, jcount = make()
    step = t2j.jit(g)
    got = [step(torch.ones(2, device="jax"))[0].item() for _ in range(4)], jcount()
    assert got[1] == want[1] == 4
    assert got[0] == pytest.approx(want[0])
    assert step.stats["traces"] <= 3


def test_tensors_made_of_traced_numbers_stay_in_the_program():
    def f(x, s):
        total = 0.0
        for part in x.chunk(2):
            total += part.sum().item()
        return (torch.tensor(s, device=x.device) + x.new_tensor([s, 2 * s]) * torch.tensor(total)
                + torch.as_tensor(math.sqrt(s)), torch.tensor(int(3), dtype=torch.float64))

    step = t2j.jit(f, fullgraph=True)
    for s in (0.5, 1.5, 2.5, 3.5):
        x = torch.arange(4.0) * s
        got, want = step(x.to("jax"), s), f(x, s)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a.cpu(), b)
    assert step.stats["traces"] <= 2  # (the second: `s` a program input)


def test_a_traced_number_stored_in_a_new_attribute_is_stored_by_every_call():
    class Holder:
        pass

    def make():
        torch.manual_seed(0)
        model, holder = torch.nn.Linear(3, 1), Holder()

        def step(x, scale):
            loss = model(x).sum() * scale
            holder.total = loss.item() if not hasattr(holder, "total") else holder.total + loss.item()
            return loss.detach()

        return model, step, holder

    x = torch.ones(4, 3)
    _, step, holder = make()
    want = []
    for scale in (1.0, 2, 3, 4):
        step(x, scale)
        want.append(holder.total)
    model, jstep, jholder = make()
    model.to("jax")
    jitted = t2j.jit(jstep)
    got = []
    for scale in (1.0, 2, 3, 4):
        jitted(x.to("jax"), scale)
        got.append(jholder.total)
    assert all(type(v) is float for v in got) and got == pytest.approx(want, rel=1e-5)


def _losses_both(build, steps=4):
    """Losses of ``build(device, jit)``'s step on the CPU and (jitted) on the jax device."""
    out = {}
    for device, jit in (("cpu", False), ("jax", True)):
        torch.manual_seed(0)
        step = build(device, jit)
        x = torch.ones(3, 4, device=device)
        out[device] = [round(float(step(x)), 5) for _ in range(steps)]
    assert out["jax"] == out["cpu"]


def test_optimizer_reached_through_nested_objects_and_scheduler_wrapper():
    import types

    def nested(device, jit):
        model = torch.nn.Linear(4, 2).to(device)
        cfg = types.SimpleNamespace(optim=types.SimpleNamespace(opt=torch.optim.Adam(model.parameters(), lr=0.1)))

        def step(x):
            opt = cfg.optim.opt
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return t2j.jit(step) if jit else step

    def opt_step_after_scheduler(device, jit):
        # the scheduler wraps opt.step, reaching the optimizer through a weak reference
        model = torch.nn.Linear(4, 2).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        opt_step = t2j.jit(opt.step) if jit else opt.step

        def step(x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt_step()
            sched.step()
            return loss.detach()

        return step

    def optimizer_in_backward(device, jit):
        # torch's "optimizer step in backward" recipe: one optimizer per parameter, stepped by its hook
        model = torch.nn.Linear(4, 2).to(device)
        opts = {p: torch.optim.Adam([p], lr=0.1) for p in model.parameters()}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

        def step(x):
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss.detach()

        return t2j.jit(step) if jit else step

    for build in (nested, opt_step_after_scheduler, optimizer_in_backward):
        _losses_both(build)


def test_optimizer_of_cpu_parameters_is_not_the_functions_state():
    # a reference run's CPU model and optimizer within reach are not refused (as CPU modules)
    cpu_model = torch.nn.Linear(4, 2)
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    models = {"cpu": (cpu_model, cpu_opt)}
    model = torch.nn.Linear(4, 2).to("jax")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @t2j.jit
    def step(x):
        assert models
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss

    step(torch.ones(3, 4, device="jax"))
    assert step.stats["eager_calls"] == 0


def test_closed_over_leaf_accumulates_its_grad_across_calls():
    grads = {}
    for device in ("cpu", "jax"):
        w = torch.nn.Parameter(torch.ones(3, device=device))  # in no module: captured by the closure

        def micro(x):
            (w * x).sum().backward()

        run = t2j.jit(micro) if device == "jax" else micro
        for i in range(4):
            run(torch.full((3,), i + 1.0, device=device))
        grads[device] = w.grad.cpu()
    torch.testing.assert_close(grads["jax"], grads["cpu"])


def test_value_dependent_read_of_a_captured_grad_runs_eagerly():
    v = torch.ones(3, device="jax", requires_grad=True)

    @t2j.jit
    def f(x):
        (v * x).sum().backward()
        return v.grad[v.grad > 1]

    with pytest.warns(UserWarning, match="runs eagerly"):
        assert f(torch.ones(3, device="jax")).numel() == 0
    assert f(torch.ones(3, device="jax")).tolist() == [2.0, 2.0, 2.0]


def test_alias_of_state_written_in_place_is_returned_as_an_alias():
    results = {}
    for device in ("cpu", "jax"):
        c = torch.zeros((), dtype=torch.long, device=device)
        f = torch.zeros(2, device=device)

        def h():
            c.add_(1)
            f.add_(1)
            return c.detach(), f[...], f.detach()

        run = t2j.jit(h) if device == "jax" else h
        first = run()
        run()
        results[device] = [t.cpu().tolist() for t in first]  # aliases: they show the second call's writes
    assert results["jax"] == results["cpu"] == [2, [2.0, 2.0], [2.0, 2.0]]


def test_plain_module_attributes_are_guarded():
    class TopK(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.k, self.temperature, self.mode = 1, 1.0, "plain"

        def forward(self, x):
            y = (x / self.temperature).topk(self.k).values
            return y * 2 if self.mode == "double" else y

    m = TopK()
    run = t2j.jit(lambda x: m(x))
    x = torch.tensor([1.0, 2.0, 3.0], device="jax")
    for k, temperature, mode in [(1, 1.0, "plain"), (2, 2.0, "plain"), (2, 2.0, "double"), (1, 1.0, "plain")]:
        m.k, m.temperature, m.mode = k, temperature, mode
        assert run(x).tolist() == m(x).tolist()
    # temperature changes: it becomes a program input; k (a size) is traced once, then static from
    # the first call that needs another value; mode (a string) retraces per value
    assert run.stats["traces"] == 4



def test_attributes_of_an_object_a_module_holds_are_guarded():
    # an HF model reads its settings from ``self.config``, shared by all its modules
    class Config:
        def __init__(self):
            self.softcap, self.mode = None, "plain"

    class Head(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config, self.lin = config, torch.nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)
            if self.config.softcap is not None:
                y = torch.tanh(y / self.config.softcap) * self.config.softcap
            return y * 2 if self.config.mode == "double" else y

    torch.manual_seed(0)
    m = Head(Config()).to("jax")
    run = t2j.jit(lambda x: m(x))
    x = torch.randn(2, 3, device="jax") * 10
    for softcap, mode in [(None, "plain"), (0.5, "plain"), (0.5, "double"), (None, "plain")]:
        m.config.softcap, m.config.mode = softcap, mode
        torch.testing.assert_close(run(x).cpu(), m(x).detach().cpu())
    assert run.stats["traces"] == 3


def test_objects_of_one_class_held_by_modules_are_guarded_apart():
    # HF Canine holds its config and a copy with num_hidden_layers=1: under one name, the two
    # numbers looked like one changing within every call (a retrace on every call)
    class Settings:
        def __init__(self, scale, n):
            self.scale, self.n = scale, n

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.w = Settings(2.0, 2), Settings(3.0, 1), torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w * self.a.scale + x[: self.a.n].sum() * 10 + x[: self.b.n].sum() * self.b.scale

    m = Model().to("jax")
    run = t2j.jit(lambda x: m(x))
    x = torch.arange(3.0, device="jax")
    for _ in range(3):
        torch.testing.assert_close(run(x).cpu(), m(x).detach().cpu())
    assert run.stats["traces"] == 1, t2j.explain_recompiles()
    m.b.scale, m.b.n = 5.0, 3  # each object's own numbers still count
    torch.testing.assert_close(run(x).cpu(), m(x).detach().cpu())


def test_hf_config_changed_after_the_first_call_is_seen():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(cfg).to("jax")
    run = t2j.jit(lambda ids: model(ids, use_cache=False))
    ids = torch.randint(0, 64, (1, 5), device="jax")
    assert run(ids).hidden_states is None
    model.config.output_hidden_states = True
    assert len(run(ids).hidden_states) == 3

def test_cpu_tensor_module_attributes_are_guarded():
    # module.to("jax") leaves plain tensor attributes on the CPU; a trace reads their values
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.scale, self.offset = torch.tensor(2.0), torch.zeros(3)

        def forward(self, x):
            return self.lin(x) * self.scale + self.offset.to(x.device)

    m = Scaled().to("jax")
    run = t2j.jit(lambda x: m(x))
    x = torch.randn(2, 3, device="jax")
    for change in (lambda: None, lambda: m.scale.fill_(3.0), lambda: m.offset.add_(1.0),
                   lambda: setattr(m, "scale", torch.tensor(-1.0))):
        change()
        torch.testing.assert_close(run(x).cpu(), m(x).cpu())
    assert run.stats["traces"] == 4


def test_module_hooks_added_or_removed_after_a_trace_retrace():
    m = torch.nn.Linear(2, 2).to("jax")
    x = torch.ones(1, 2, device="jax")
    run = t2j.jit(lambda x: m(x))
    module_hooks = torch.nn.modules.module
    changes = [
        lambda: m.register_forward_hook(lambda mod, i, o: o * 0),
        lambda: m.register_forward_pre_hook(lambda mod, i: (i[0] * 2,)),
        lambda: module_hooks.register_module_forward_hook(lambda mod, i, o: o + 1),
        lambda: module_hooks.register_module_forward_pre_hook(lambda mod, i: (i[0] - 1,)),
    ]
    run(x)
    for change in changes:
        handle = change()
        try:
            torch.testing.assert_close(run(x).cpu(), m(x).cpu())
        finally:
            handle.remove()
        torch.testing.assert_close(run(x).cpu(), m(x).cpu())


def test_full_backward_pre_hook_removed_after_a_trace():
    m = torch.nn.Linear(2, 2).to("jax")
    x = torch.ones(3, 2, device="jax")

    def step(x):
        m.zero_grad()
        m(x).sum().backward()
        return m.weight.grad.clone()

    run = t2j.jit(step)
    handle = m.register_full_backward_pre_hook(lambda mod, go: (go[0] * 10,))
    torch.testing.assert_close(run(x).cpu(), step(x).cpu())
    handle.remove()
    torch.testing.assert_close(run(x).cpu(), step(x).cpu())


def test_tensor_and_optimizer_hooks_added_or_removed_after_a_trace():
    # a gradient hook on a tensor the step closes over, a post-accumulate-grad hook, an optimizer's
    # step hooks and the global ones: each added or removed between calls is another program
    def run(device, wrap):
        torch.manual_seed(0)
        w = torch.zeros(3, device=device, requires_grad=True)
        m = torch.nn.Linear(3, 1).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x):
            w.grad = None
            opt.zero_grad()
            (m(x).sum() + (w * x).sum()).backward()
            opt.step()
            return w.grad.clone(), m.bias.detach().clone()

        f = wrap(step)
        x = torch.ones(2, 3, device=device)
        def triple_grad(t):
            t.grad.mul_(3)

        def zero_bias(*_):
            m.bias.data.zero_()

        def drop_bias_grad(*_):
            m.bias.grad.mul_(0)

        def fill_bias(*_):
            m.bias.data.fill_(7)

        changes = [
            lambda: w.register_hook(lambda g: g * 5),
            lambda: w.register_post_accumulate_grad_hook(triple_grad),
            lambda: opt.register_step_post_hook(zero_bias),
            lambda: opt.register_step_pre_hook(drop_bias_grad),
            lambda: register_optimizer_step_post_hook(fill_bias),
        ]
        out = [f(x)]
        for change in changes:
            handle = change()
            out.append(f(x))
            handle.remove()
            out.append(f(x))
        return [[t.tolist() for t in pair] for pair in out]

    from torch.optim.optimizer import register_optimizer_step_post_hook

    assert run("jax", t2j.jit) == run("cpu", lambda f: f)


def test_a_retrace_names_the_changed_value_of_two_hooks_that_name_it_alike():
    # (the two cells were one guard and one lifted number: the retrace crashed, and explaining it raised
    # StopIteration; HF's output-capturing hooks all close over one name)
    def scaling(scale):
        def hook(module, inputs, output):
            return output * scale
        return hook

    first, second = scaling(1.0), scaling(2.0)
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).to("jax")
    m[0].register_forward_hook(first)
    m[1].register_forward_hook(second)
    run = t2j.jit(lambda x: m(x))
    x = torch.ones(1, 2, device="jax")
    run(x)
    first.__closure__[0].cell_contents = 3.0
    torch.testing.assert_close(run(x).cpu(), m(x).cpu())
    assert any("hook: scale: 1.0 ->" in line for line in t2j.explain_recompiles())
    first.__closure__[0].cell_contents = 4.0  # (a program input now)
    torch.testing.assert_close(run(x).cpu(), m(x).cpu())


def test_averaged_model_with_its_counter_on_the_cpu():
    # AveragedModel(model) registers n_averaged on the CPU (device=None), as on CUDA
    from torch.optim.swa_utils import AveragedModel

    results = []
    for device in ("cpu", "jax"):
        torch.manual_seed(0)
        m = torch.nn.Linear(2, 2).to(device)
        swa = AveragedModel(m)
        update = (lambda: swa.update_parameters(m)) if device == "cpu" else t2j.jit(lambda: swa.update_parameters(m))
        for _ in range(3):
            with torch.no_grad():
                m.weight.add_(1.0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                update()
        results.append((swa.n_averaged.item(), swa.module.weight.detach().cpu()))
    assert results[0][0] == results[1][0] == 3
    torch.testing.assert_close(results[1][1], results[0][1])


_SCALE, _CONFIG, _FLAG = 2.0, {"shift": 1.0}, True


def test_python_values_the_function_reads_are_guarded():
    # as torch.compile guards them: a new value traces again instead of reusing the old constant
    global _SCALE, _FLAG
    import types

    cfg = types.SimpleNamespace(scale=2.0, unused=0)
    k = 1.0
    run = t2j.jit(lambda x: (x * _SCALE * k * cfg.scale + _CONFIG["shift"]) if _FLAG else -x)
    x = torch.ones(2, device="jax")

    def expected():
        return (x * _SCALE * k * cfg.scale + _CONFIG["shift"]) if _FLAG else -x

    try:
        for change in ("none", "global", "closure", "attribute", "unused", "dict", "flag"):
            if change == "global":
                _SCALE = 3.0
            elif change == "closure":
                k = 5.0
            elif change == "attribute":
                cfg.scale = 4.0
            elif change == "unused":
                cfg.unused = 7  # not named by the function: no retrace
            elif change == "dict":
                _CONFIG["shift"] = 6.0
            elif change == "flag":
                _FLAG = False
            torch.testing.assert_close(run(x).cpu(), expected().cpu())
        assert run.stats["traces"] == 6
        assert "the Python value global _FLAG: True -> False" in t2j.explain_recompiles()[-1]
    finally:
        _SCALE, _FLAG, _CONFIG["shift"] = 2.0, True, 1.0


def test_items_of_lists_the_function_reads_are_guarded():
    # ``scale[0]``, a list in a tuple: a new item traces again (or, for a number changing from call to
    # call, becomes a program input); a string item retraces
    scale, nested, modes = [2.0], (1.0, [4.0]), ["sum", "x"]
    run = t2j.jit(lambda x: (x * scale[0] * nested[1][0]).sum() if modes[0] == "sum" else x.mean())
    x = torch.ones(3, device="jax")
    got = []
    for s, n, mode in [(2.0, 4.0, "sum"), (5.0, 4.0, "sum"), (5.0, 7.0, "sum"), (5.0, 7.0, "mean"), (6.0, 7.0, "sum")]:
        scale[0], nested[1][0], modes[0] = s, n, mode
        got.append(run(x).item())
    assert got == [24.0, 60.0, 105.0, 1.0, 126.0]


def test_a_python_value_changing_every_call_warns():
    # a number that is a size cannot be a program input: each new value is a new program
    step = 0
    run = t2j.jit(lambda x: x.repeat(step + 1))
    x = torch.ones(2, device="jax")
    with pytest.warns(UserWarning, match="compiled again 8 times because Python values it reads changed"):
        for step in range(9):
            assert run(x).tolist() == [1.0] * 2 * (step + 1)


_BETA = 0.0


def test_python_numbers_that_change_become_program_inputs():
    # as jax.jit traces Python floats and torch.compile makes a changing int dynamic: from the
    # first change on, a number (argument, closure cell, global, attribute, dict item) is an input
    global _BETA
    import types

    cfg, table = types.SimpleNamespace(gain=1.0), {"shift": 0.0}
    k = 1.0

    def f(x, w, n):
        y = x * w + n + _BETA * k - cfg.gain * table["shift"]
        return y, w * 2, n + 1

    run = t2j.jit(f)
    x = torch.ones(2, device="jax")
    try:
        for i in range(6):
            _BETA, k, cfg.gain, table["shift"] = 0.5 * i, 1.0 + i, 2.0 - i, 0.25 * i
            got, want = run(x, 0.1 * i, i), f(x.cpu(), 0.1 * i, i)
            torch.testing.assert_close(got[0].cpu(), want[0])
            # numbers computed from them come back as Python numbers, as torch gives them
            assert (type(got[1]), type(got[2])) == (float, int) and got[1:] == want[1:]
        assert run.stats["traces"] == 2
        assert "new values need no new trace" in t2j.explain_recompiles()[-1]
    finally:
        _BETA = 0.0


def test_a_number_input_keeps_torch_type_promotion():
    # a traced number is still a Python number to type promotion: int and half tensors keep their
    # category and width, as `x * 0.5` does
    run = t2j.jit(lambda xi, xh, w: (xi * w, xh * w, torch.full((2,), w, device="jax"), xi + int(w > 0)))
    xi, xh = torch.arange(3, device="jax"), torch.ones(3, device="jax", dtype=torch.bfloat16)
    for w in (0.5, 1.5, 2.5):
        a, b, c, d = run(xi, xh, w)
        assert (a.dtype, b.dtype, c.dtype, d.dtype) == (torch.float32, torch.bfloat16, torch.float32, torch.int64)
        assert a.tolist() == [0.0, w, 2 * w] and c.tolist() == [w, w]
    assert run.stats["traces"] == 2


def test_a_number_used_as_a_size_or_exactly_stays_static():
    # a shape, a range(n) loop or math.exp(w) needs the value itself: such a number goes back to
    # being static (one trace per value, as before), never a wrong answer
    import math

    sized = t2j.jit(lambda x, n: torch.cat([x, torch.zeros(n, device="jax")]).sum() + sum(x[0] for _ in range(n)))
    exact = t2j.jit(lambda x, w: x * math.exp(w))
    x = torch.ones(3, device="jax")
    for i in range(1, 6):
        assert sized(x, i).item() == 3.0 + i
        torch.testing.assert_close(exact(x, 0.1 * i).cpu(), torch.ones(3) * math.exp(0.1 * i))
    assert sized.stats["traces"] <= 7 and exact.stats["traces"] <= 7
    assert len(sized._cache) + len(exact._cache) <= 12  # blocked numbers do not pile up guarded entries


def test_a_branch_on_a_number_input_is_guarded():
    run = t2j.jit(lambda x, w: x * w if w > 0.5 else x - w)
    x = torch.ones(2, device="jax")
    for w in (0.1, 0.2, 0.7, 0.9, 0.3, 0.8):
        torch.testing.assert_close(run(x, w).cpu(), (torch.ones(2) * w if w > 0.5 else torch.ones(2) - w))
    assert run.stats["traces"] == 3  # static, then one program per side of the branch


def _indexed_runs_match(make_step, calls, **jit_options) -> dict:
    """Run ``make_step(table, cache, w)`` on the CPU and jitted on the jax device, once per argument tuple of
    ``calls(device)``; assert the outputs, the cache it writes and ``w.grad`` match; the jitted run's stats."""
    def run(device):
        torch.manual_seed(0)
        table, cache = torch.randn(6, 4).to(device), torch.zeros(2, 6, 4).to(device)
        w = torch.randn(6, 4).to(device).requires_grad_()
        step = make_step(table, cache, w)
        f = step if device == "cpu" else t2j.jit(step, **jit_options)
        outs = [[o.detach().cpu() for o in f(*args)] for args in calls(device)]
        return outs, cache.cpu(), w.grad.cpu(), getattr(f, "stats", None)

    want, got = run("cpu"), run("jax")
    for a, b in zip(want[0], got[0]):
        for u, v in zip(a, b):
            torch.testing.assert_close(v, u)
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
    return got[3]


def test_an_int_input_indexes_tensors_without_a_program_per_value():
    # ``alphas[t]`` in a diffusion sampler, ``cache[:, pos] = k`` in a decoder: the int is a
    # program input and the indexing a view at a position the program computes; reads, writes
    # through views of views, negative indices and gradients match the CPU
    def make_step(table, cache, w):
        def step(x, t):
            a = table[t]
            cache[:, t] = x * a
            cache[1, t - 1, 0] = 5.0
            r = cache[0][t]
            r.mul_(2)
            (w[-t] * x).sum().backward()
            return a.sum() + r.sum(), table[..., t % 4], cache[None, 0, t]

        return step

    stats = _indexed_runs_match(make_step,
                                lambda device: [(torch.arange(4.0).to(device) + t, t) for t in (1, 2, 3, 5, 2)])
    assert stats["traces"] == 2


def test_a_0d_tensor_indexes_tensors_in_one_program():
    # ``q[action]``, ``emb[logits.argmax()]``, ``cache[:, pos] = k`` with ``pos`` a 0-d tensor: torch's indexing
    # reads such an index's value (a select), which the program computes (it used to stop the trace)
    def make_step(table, cache, w):
        def step(logits, pos):
            i = logits.argmax()
            cache[:, pos] = table[i]
            cache[0, pos - 1, i % 4] = 5.0
            (w[i] * table[:, pos % 4].sum()).sum().backward()
            return table[i], cache[1, pos], table[i, pos % 4]

        return step

    stats = _indexed_runs_match(make_step, lambda device: [(torch.randn(6).to(device), torch.tensor(p).to(device))
                                                           for p in (1, 3, 5, 2)], fullgraph=True)
    assert stats["traces"] == 2  # (the first call makes w.grad: the second has it as state)


def test_a_0d_uint8_tensor_index_stays_a_mask():
    # torch takes a 0-d uint8 or bool index as a mask (an added dimension of 0 or 1 rows), not a position
    x = torch.arange(6.0).reshape(2, 3)
    for index in (torch.tensor(1, dtype=torch.uint8), torch.tensor(False)):
        got = t2j.jit(lambda x, i: x[i] * 2)(x.to("jax"), index.to("jax"))
        torch.testing.assert_close(got.cpu(), x[index] * 2)

def test_an_int_input_in_slice_bounds_of_a_fixed_length():
    # x[t:t + k] and narrow(0, t, k): one program for every t (the length and bounds are guards)
    def run(device):
        src, buf = torch.arange(30.0).reshape(10, 3).to(device), torch.zeros(10, 3).to(device)

        def step(x, t):
            buf[t:t + 2] = x[:2] * 2
            return src[t:t + 3].sum(0), src.narrow(0, t, 4).sum(), buf[t + 1].clone()

        f = step if device == "cpu" else t2j.jit(step)
        outs = [[o.cpu() for o in f(torch.ones(3, 3).to(device) * t, t)] for t in (0, 2, 5, 6, 3)]
        return outs, buf.cpu(), getattr(f, "stats", None)

    want, got = run("cpu"), run("jax")
    for a, b in zip(want[0], got[0]):
        for u, v in zip(a, b):
            torch.testing.assert_close(v, u)
    torch.testing.assert_close(got[1], want[1])
    assert got[2]["traces"] == 2


def test_an_int_input_out_of_range_raises_torch_s_index_error():
    f = t2j.jit(lambda x, t: x[t] * 2)
    x = torch.arange(5.0, device="jax")
    assert [f(x, t).item() for t in (1, 2, -5)] == [2.0, 4.0, 0.0]
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 0 with size 5"):
        f(x, 5)


def test_a_number_input_never_meets_a_cpu_tensor():
    # torch's own CPU kernels do not know a traced number's value (they would compute with a
    # placeholder): such an op stops the trace, and the number stays static
    table = torch.arange(4)
    run = t2j.jit(lambda x, n: (table + n).sum() + x)
    x = torch.zeros((), device="jax")
    assert [run(x, n).item() for n in range(4)] == [6.0 + 4 * n for n in range(4)]
    assert any("computed a CPU tensor from a traced number" in m for m in t2j.explain_recompiles())


def test_a_number_from_item_never_meets_a_cpu_tensor():
    # torch's argument parser puts a placeholder where a symbolic number goes in a tensor position
    table = torch.arange(4)
    run = t2j.jit(lambda x: (table + x.sum().int().item()).sum(), fullgraph=True)
    with pytest.raises(t2j.OpError, match="add computed a CPU tensor from a traced number"):
        run(torch.ones(3, device="jax"))
    assert t2j.jit(lambda x: (table + x.sum().int().item()).sum())(torch.ones(3, device="jax")).item() == 18


def test_an_item_number_indexes_inside_the_program():
    x = torch.arange(10.0, device="jax")
    run = t2j.jit(lambda x, i: x[i.item()] + x[:, None][i.item(), 0], fullgraph=True)
    assert [run(x, torch.tensor(k, device="jax")).item() for k in (2, 7, -1)] == [4.0, 14.0, 18.0]
    assert run.stats["traces"] == 1


def test_a_trace_leaves_tensors_no_sequences():
    t2j.jit(lambda x, i: x[i:i + 1] * 2)(torch.arange(4.0, device="jax"), 1)
    assert torch.tensor([torch.tensor(1.5), torch.tensor(2.5)]).tolist() == [1.5, 2.5]


def test_deleting_a_module_attribute_retraces():
    m = torch.nn.Linear(3, 1).to("jax")
    m.scale = 2.0
    run = t2j.jit(lambda x: m(x) * getattr(m, "scale", 1.0))
    x = torch.ones(2, 3, device="jax")
    run(x)
    del m.scale
    torch.testing.assert_close(run(x).cpu(), m(x).cpu())
    assert run.stats["traces"] == 2


def test_in_place_layout_changes_of_state_run_eagerly():
    # resize_ / t_ / unsqueeze_ on an argument or a captured tensor: a compiled call writes values
    # back, not shapes, so these calls run as torch does (a graph break)
    def grow(z):
        z.resize_(8)
        z[6:] = 7.0
        return z.sum()

    buf = torch.ones(2, 3, device="jax")
    run_grow, run_t = t2j.jit(grow), t2j.jit(lambda z: z.t_() + 0)
    run_unsqueeze = t2j.jit(lambda x: buf.unsqueeze_(0).sum() + x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(3):
            z = torch.arange(6.0, device="jax")
            assert run_grow(z).item() == 29.0 and z.tolist() == [0, 1, 2, 3, 4, 5, 7, 7]
            w = torch.ones(2, 3, device="jax")
            run_t(w)
            assert w.shape == (3, 2) and w.stride() == (1, 3)
            run_unsqueeze(torch.ones(1, device="jax"))
            assert buf.shape == (1,) * (i + 1) + (2, 3)


def test_a_forward_set_on_the_instance_retraces():
    # as accelerate and peft wrap a module's forward: the jitted function calls the new one
    torch.manual_seed(0)
    m = nn.Linear(2, 2).to("jax")
    run = t2j.jit(lambda x: m(x).sum())
    x = torch.ones(1, 2, device="jax")
    plain = run(x).item()
    original = m.forward
    m.forward = lambda inp: original(inp) * 10
    assert run(x).item() == pytest.approx(plain * 10, rel=1e-5)
    m.forward = original
    assert run(x).item() == pytest.approx(plain, rel=1e-6)


@pytest.mark.parametrize("name", ["RAdam", "NAdam", "Adamax", "ASGD"])
def test_float64_optimizers_keep_their_digits_under_jit(name):
    # their capturable path computes bias corrections from the step counter tensors: in float64
    # while traced (float32 again in the state), as the eager path computes them in Python floats
    results = []
    for device, wrap in (("cpu", lambda f: f), ("jax", t2j.jit)):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(8, dtype=torch.float64).to(device))
        opt = getattr(torch.optim, name)([p], lr=0.01)

        def step():
            opt.zero_grad()
            (p * p).sum().backward()
            opt.step()

        run = wrap(step)
        for _ in range(10):
            run()
        results.append((p.detach().cpu(), opt.state_dict()["state"][0]))
    (p_cpu, state_cpu), (p_jax, state_jax) = results
    torch.testing.assert_close(p_jax, p_cpu, rtol=0, atol=1e-8)
    for k, v in state_cpu.items():
        if isinstance(v, torch.Tensor):
            assert state_jax[k].dtype == v.dtype, k


def test_clip_grad_norm_error_under_jit_says_the_norm_type():
    p = nn.Parameter(torch.ones(3, device="jax"))

    def clip():
        p.grad = torch.full((3,), float("inf"), device="jax")
        return torch.nn.utils.clip_grad_norm_([p], 1.0, norm_type=3.0, error_if_nonfinite=True)

    with pytest.raises(RuntimeError, match="The total norm of order 3.0 for gradients from `parameters` is non-finite"):
        t2j.jit(clip)()


def test_a_trace_that_stops_leaves_the_modules_as_they_were():
    # pruning inside the function: the trace swaps weight for weight_orig, a mask and a hook, then
    # stops at a value-dependent op; the eager run that follows must start from the modules as given
    import torch.nn.utils.prune as prune

    results = []
    for device in ("cpu", "jax"):
        torch.manual_seed(0)
        m = nn.Linear(6, 4).to(device)
        x = torch.randn(3, 6).to(device)
        prune.l1_unstructured(m, "weight", amount=0.3)

        def f(x):
            prune.l1_unstructured(m, "weight", amount=0.3)
            return m(x)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = (t2j.jit(f) if device == "jax" else f)(x)
        results.append((out.detach().cpu(), (m.weight == 0).sum().item(), sorted(dict(m.named_parameters()))))
    torch.testing.assert_close(results[1][0], results[0][0])
    assert results[1][1:] == results[0][1:]


def test_a_functions_forward_changes_its_arguments_objects_once():
    # an autograd.Function whose forward appends to a cache object it is given (Reformer's
    # past_buckets_states): under jit it also runs again for JAX to differentiate, which must
    # neither see nor repeat the first run's change
    class Cache:
        def __init__(self):
            self.states = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, cache):
            cache.states.append(x.shape[0])
            return x * (len(cache.states) + 1)

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    w = nn.Parameter(torch.ones(3, device="jax"))

    def step(cache):
        y = Scale.apply(w * 1.0, cache)
        y.sum().backward()
        return y

    for _ in range(2):
        cache = Cache()
        w.grad = None
        y = t2j.jit(step)(cache)
        assert y.tolist() == [2.0, 2.0, 2.0] and w.grad.tolist() == [2.0, 2.0, 2.0]
        assert cache.states == [3]


def test_a_module_attribute_number_that_changes_becomes_a_program_input():
    # an annealed temperature on the module: one more trace, not one per value; a size (topk's k)
    # stays static and retraces per value
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.temperature, self.k = nn.Linear(4, 4), 1.0, 2

        def forward(self, x):
            return torch.topk(self.lin(x) / self.temperature, self.k).values

    torch.manual_seed(0)
    model = Scaled().to("jax")
    run = t2j.jit(lambda x: model(x).sum())
    x = torch.randn(3, 4, device="jax")
    for i in range(6):
        model.temperature = 1.0 + 0.5 * i
        torch.testing.assert_close(run(x).cpu(), model(x).sum().cpu())
    assert run.stats["traces"] == 2
    model.k = 3
    torch.testing.assert_close(run(x).cpu(), model(x).sum().cpu())


def test_a_jitted_function_under_torch_func_transforms_runs_eagerly():
    f = t2j.jit(lambda x: (x.sin() * x).sum())
    x = torch.tensor([0.5, -1.0, 2.0])
    with pytest.warns(UserWarning, match="under a torch.func transform"):
        got = torch.func.grad(f)(x.to("jax"))
    torch.testing.assert_close(got.cpu(), torch.func.grad(lambda x: (x.sin() * x).sum())(x))
    torch.testing.assert_close(torch.func.hessian(f)(x.to("jax")).cpu(),
                               torch.func.hessian(lambda x: (x.sin() * x).sum())(x))
    assert f(x.to("jax")).item() == pytest.approx((x.sin() * x).sum().item())
    with pytest.raises(t2j.JitError, match="torch.func transforms"):
        torch.func.vmap(t2j.jit(lambda x: x.sum(), fullgraph=True))(torch.ones(2, 3, device="jax"))


def test_a_forward_mode_dual_argument_keeps_its_tangent():
    import torch.autograd.forward_ad as fwAD

    def f(x):
        return x.exp() * x.sum()

    x = torch.tensor([0.5, -1.0, 2.0])
    tangents = []
    for device, fn in (("cpu", f), ("jax", t2j.jit(f))):
        with fwAD.dual_level():
            tangents.append(fwAD.unpack_dual(fn(fwAD.make_dual(x.to(device), torch.ones(3, device=device)))).tangent)
    torch.testing.assert_close(tangents[1].cpu(), tangents[0])


def test_a_jitted_function_called_inside_another_is_part_of_its_program():
    """A jitted forward (`t2j.jit(model)`) called by a jitted train step: inlined into the step's
    program, as torch.compile inlines, with its dropout masks fresh on every call."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = copy.deepcopy(ref).to("jax")
    fwd = t2j.jit(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    @t2j.jit
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(fwd(x), y)
        loss.backward()
        opt.step()
        return loss

    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            ref_opt.zero_grad()
            expected = F.mse_loss(ref(x), y)
            expected.backward()
            ref_opt.step()
            torch.testing.assert_close(step(x.to("jax"), y.to("jax")).cpu(), expected.detach())
    assert step.stats["eager_calls"] == 0 and fwd.stats["traces"] == fwd.stats["calls"] == 0

    noisy = t2j.jit(lambda x: F.dropout(x, 0.5))
    outer = t2j.jit(lambda x: noisy(x) + 0)
    ones = torch.ones(64, device="jax")
    assert not torch.equal(outer(ones).cpu(), outer(ones).cpu())


def test_forward_mode_ad_with_python_scalars_stays_one_program():
    """Forward-mode AD makes meta-device stand-ins of a wrapped Python number's operands
    (``_to_copy(device="meta")``): inside a trace they need no values."""
    x = torch.tensor([1.0, 2.0, 3.0])
    hess = t2j.jit(lambda x: torch.func.hessian(lambda x: (x**3 * 0.5).sum())(x), fullgraph=True)
    torch.testing.assert_close(hess(x.to("jax")).cpu(), torch.func.hessian(lambda x: (x**3 * 0.5).sum())(x))
    jvp = t2j.jit(lambda x: torch.func.jvp(lambda x: x * 2 + 1, (x,), (torch.ones_like(x),)), fullgraph=True)
    for got, want in zip(jvp(x.to("jax")), torch.func.jvp(lambda x: x * 2 + 1, (x,), (torch.ones_like(x),))):
        torch.testing.assert_close(got.cpu(), want)
    assert t2j.jit(lambda x: x.to("meta").shape, fullgraph=True)(x.to("jax")) == (3,)



class _Holder:
    pass


class _Accumulating(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.lin = nn.Linear(3, 3).to(device)
        self.total = torch.zeros(3, device=device)  # a plain attribute: neither parameter nor buffer

    def forward(self, x):
        self.total = self.total + self.lin(x)
        return self.total * 2


def _store_module_attribute(device):
    m = _Accumulating(device)
    return m, lambda: m.total


def _store_module_output(device):
    lin = nn.Linear(3, 3).to(device)
    holder = _Holder()
    holder.last = None

    def f(x):
        y = lin(x)
        holder.last = y.detach()
        return y.sum()
    return f, lambda: holder.last


def _store_argument(device):
    holder = _Holder()

    def f(x):
        holder.seen = x
        return x + 1
    return f, lambda: holder.seen


def _store_view_of_argument(device):
    holder = _Holder()

    def f(x):
        holder.tail = x[1:]
        return x * 2
    return f, lambda: holder.tail


def _store_none(device):
    holder = _Holder()
    holder.bias = torch.ones(3, device=device)

    def f(x):
        y = x if holder.bias is None else x + holder.bias
        holder.bias = None
        return y
    return f, lambda: holder.bias


def _store_in_closure_cell(device):
    total = torch.zeros(3, device=device)

    def f(x):
        nonlocal total
        total = total * 0.5 + x
        return total.sum()
    return f, lambda: total


_GLOBAL_TOTAL = None


def _store_in_global(device):
    global _GLOBAL_TOTAL
    _GLOBAL_TOTAL = torch.zeros(3, device=device)

    def f(x):
        global _GLOBAL_TOTAL
        _GLOBAL_TOTAL = _GLOBAL_TOTAL - x
        return x
    return f, lambda: _GLOBAL_TOTAL


def _store_in_dict_item(device):
    cache = {"k": torch.zeros(3, device=device)}

    def f(x):
        cache["k"] = cache["k"] + x
        return x
    return f, lambda: cache["k"]


def _store_in_argument_object(device):
    holder = _Holder()
    holder.total = torch.zeros(3, device=device)

    def f(x, h):
        h.total = h.total + x
        return x.sum()
    return functools.partial(_call_with, f, holder), lambda: holder.total


def _call_with(f, holder, x):
    return f(x, holder)


@pytest.mark.parametrize("make", [
    _store_module_attribute, _store_module_output, _store_argument, _store_view_of_argument, _store_none,
    _store_in_closure_cell, _store_in_global, _store_in_dict_item, _store_in_argument_object,
])
def test_tensors_stored_by_assignment_are_stored_again_on_cached_calls(make):
    # a cached call runs no Python: the stores its trace made are repeated after it, with this call's values
    def run(device, jit):
        torch.manual_seed(0)
        fn, read = make(device)
        g = t2j.jit(fn) if jit else fn
        seen = []
        for i in range(3):
            x = torch.arange(3.0, device=device) + i
            out = g(x)
            stored = read()
            seen.append((out, stored))
            x.add_(10)  # (where the argument itself or a view of it was stored, the write reaches it)
        return [(o.cpu(), None if s is None else s.cpu()) for o, s in seen], g
    want, _ = run("cpu", False)
    got, g = run("jax", True)
    for (o1, s1), (o2, s2) in zip(want, got):
        torch.testing.assert_close(o2, o1)
        assert (s1 is None) == (s2 is None)
        if s1 is not None:
            torch.testing.assert_close(s2, s1)
    # (a place that held no tensor before the first call holds new state after it: one more trace)
    assert g.stats["hits"] >= 1


class _WithAuxLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.aux_loss = None

    def forward(self, x):
        h = self.lin(x)
        self.aux_loss = h.pow(2).mean()  # read by the training loop after the forward, as MoE layers do
        self.last = h
        return h


def test_stored_tensors_carry_the_calls_gradient():
    def losses(device, jit):
        torch.manual_seed(0)
        m = _WithAuxLoss().to(device)
        fwd = t2j.jit(m) if jit else m
        for _ in range(3):
            m.zero_grad()
            out = fwd(torch.arange(6.0, device=device).view(2, 3))
            assert m.last is out
            (out.sum() + m.aux_loss).backward()
        return m.aux_loss.detach().cpu(), m.lin.weight.grad.cpu()
    for want, got in zip(losses("cpu", False), losses("jax", True)):
        torch.testing.assert_close(got, want)


_UNRELATED_GLOBAL = "kept"


def test_a_stopped_trace_leaves_the_functions_globals_alone():
    def f(x):
        if x.sum() > 0:  # a value-dependent branch: the trace stops, the call runs eagerly
            return x * 2
        return x

    with pytest.warns(UserWarning, match="runs eagerly"):
        t2j.jit(f)(torch.ones(2, device="jax"))
    assert _UNRELATED_GLOBAL == "kept"


_CALLS = 0


def test_a_stopped_trace_does_not_repeat_the_functions_python_side_effects():
    # Python bookkeeping before a value-dependent branch: the trace stops there and the call runs
    # eagerly, which must start from the state as the call found it (each change made once)
    class Counter:
        n = 0

    counter, table, ema = Counter(), {"k": 0}, torch.ones(3)

    def f(x):
        global _CALLS
        _CALLS += 1
        counter.n += 1
        table["k"] += 1
        ema.mul_(0.5)
        if x.sum() > 0:
            return x * 2
        return x

    jitted = t2j.jit(f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            jitted(torch.ones(2, device="jax"))
    assert (_CALLS, counter.n, table["k"]) == (3, 3, 3) and jitted.stats["eager_calls"] == 3
    torch.testing.assert_close(ema, torch.full((3,), 0.125))


def test_a_write_into_a_cpu_tensor_at_a_position_the_program_takes_is_made():
    # hist[i] of a CPU tensor with a lifted i is read from a device copy; writing it must reach hist
    hist = torch.zeros(4)

    def f(x, i):
        hist[i].copy_(x.sum())
        return x * 2

    jitted = t2j.jit(f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(4):
            jitted(torch.full((2,), float(k), device="jax"), k)
    torch.testing.assert_close(hist, torch.tensor([0.0, 2.0, 4.0, 6.0]))


def test_requires_grad_set_on_state_inside_the_step_is_set_by_every_call():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).to("jax")

    def step(x, freeze):
        model[0].requires_grad_(not freeze)
        model.zero_grad()
        model(x).sum().backward()

    jitted = t2j.jit(step, fullgraph=True)
    for freeze in (True, False, True, False, True):
        jitted(torch.ones(1, 2, device="jax"), freeze)
        assert model[0].weight.requires_grad is (not freeze) and (model[0].weight.grad is None) is freeze
    assert jitted.stats["hits"] >= 1


def test_a_hyperparameter_set_from_a_number_argument_is_set_by_every_call():
    # a momentum schedule passed in: its first value is the group's (no change), the next ones are
    # traced numbers stored into the group, which must become program inputs, not leak out
    torch.manual_seed(0)
    base = nn.Linear(2, 1)

    def make(device):
        model = copy.deepcopy(base).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, momentum):
            opt.param_groups[0]["momentum"] = momentum
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()

        return model, opt, step

    (model, _, step), (ours, opt_j, jitted) = make("cpu"), make("jax")
    jitted = t2j.jit(jitted, fullgraph=True)
    for momentum in (0.9, 0.8, 0.7, 0.6):
        x = torch.full((1, 2), momentum)
        step(x, momentum)
        jitted(x.to("jax"), momentum)
        assert type(opt_j.param_groups[0]["momentum"]) is float and opt_j.param_groups[0]["momentum"] == momentum
    for p, q in zip(ours.parameters(), model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())
    assert jitted.stats["compiles"] <= 3


def test_values_computed_from_constants_are_known_to_the_trace():
    # ops on constants run at trace time (small results): reading their values does not stop the trace
    def f(x):
        idx = torch.arange(x.shape[0], device=x.device)
        mask = torch.tensor([True, False, True, True], device=x.device)
        return x[mask] * int(idx.sum()) + torch.nonzero(mask).sum(), idx.tolist()

    x = torch.arange(4.0)
    g = t2j.jit(f)
    for _ in range(2):
        out, idx = g(x.to("jax"))
    want, want_idx = f(x)
    torch.testing.assert_close(out.cpu(), want)
    assert idx == want_idx and g.stats["eager_calls"] == 0 and g.stats["hits"] == 1


def test_packed_sequence_with_lengths_on_the_cpu_compiles():
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, batch_first=True)

    def f(lstm, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = lstm(packed)
        return pad_packed_sequence(out, batch_first=True)[0].sum(1)

    x = torch.randn(2, 5, 3)
    jlstm = copy.deepcopy(lstm).to("jax")
    g = t2j.jit(functools.partial(f, jlstm))
    for lengths in ([5, 3], [5, 3], [4, 4], [3, 5]):
        lengths = torch.tensor(lengths)  # on the CPU, as torch wants it: its values are constants of the program
        torch.testing.assert_close(g(x.to("jax"), lengths).cpu(), f(lstm, x, lengths), rtol=1e-5, atol=1e-5)
    assert g.stats["eager_calls"] == 0 and g.stats["hits"] == 1


def test_integer_cpu_arguments_go_to_the_device_in_the_eager_run_of_a_graph_break():
    # (the trace is tried again with them on the CPU, for their values; that stops too, and the eager run
    # takes them on the device, as every compiled call does: a jax model's embedding reads them there)
    torch.manual_seed(0)
    emb, lin = nn.Embedding(10, 4), nn.Linear(4, 3)

    def make_step(emb, lin):
        def step(idx, y):
            loss = F.cross_entropy(lin(emb(idx)), y)
            return loss, (idx > 1).nonzero()  # (a value-dependent shape: a graph break)

        return step

    step, jitted = make_step(emb, lin), t2j.jit(make_step(copy.deepcopy(emb).to("jax"), copy.deepcopy(lin).to("jax")))
    for _ in range(3):
        idx, y = torch.tensor([1, 2]), torch.tensor([0, 1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = jitted(idx, y)
        for a, b in zip(got, step(idx, y)):
            torch.testing.assert_close(a.cpu(), b)
    assert jitted.stats["eager_calls"] == 3


def test_nan_times_a_false_mask_stays_nan_in_a_program():
    # XLA turns x * convert(mask) into a select that drops x's NaN and inf where the mask is False
    def f(x, mask):
        return x * mask, (x * mask).sum(), x * mask.float(), mask.to(x.dtype) * x

    x = torch.tensor([float("nan"), 1.0, float("inf"), -2.0])
    mask = torch.tensor([False, False, True, False])
    want = f(x, mask)
    got = t2j.jit(f)(x.to("jax"), mask.to("jax"))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, equal_nan=True)


def test_distribution_validation_becomes_a_check_of_the_program(monkeypatch):
    import torch.distributions as D

    monkeypatch.setattr(D.Distribution, "_validate_args", True)  # (importing torch._dynamo turns it off)

    def log_prob(loc, scale, validate):
        return D.Normal(loc, scale, validate_args=validate).log_prob(loc + 1)

    loc, good, bad = torch.zeros(3, device="jax"), torch.ones(3, device="jax"), -torch.ones(3, device="jax")
    asked = t2j.jit(functools.partial(log_prob, validate=True))
    torch.testing.assert_close(asked(loc, good).cpu(), log_prob(loc.cpu(), good.cpu(), True))
    # (the failed check runs the call again eagerly: torch's own error, after the ops before it)
    with pytest.raises(ValueError, match="Expected parameter scale .* to satisfy the constraint"):
        asked(loc, bad)
    assert asked.stats["eager_calls"] == 0 and asked.stats["traces"] == 1
    default = t2j.jit(functools.partial(log_prob, validate=None))
    assert default(loc, bad).isnan().all()  # torch's default validation costs a host sync per step: off
    with t2j.env(check_indices="always"):
        checked = t2j.jit(functools.partial(log_prob, validate=None))
        with pytest.raises(ValueError, match="to satisfy the constraint"):
            checked(loc, bad)
    with pytest.raises(ValueError, match="does not satisfy its constraint"):  # (the program's own check)
        t2j.jit(functools.partial(log_prob, validate=True), fullgraph=True)(loc, bad)


def test_modes_set_inside_are_set_again_by_cached_calls():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).to("jax")

    @t2j.jit
    def evaluate(x):
        model.eval()
        return model(x).sum()

    for _ in range(3):
        model.train()  # as a training loop does between evaluations
        evaluate(torch.ones(2, 3, device="jax"))
        assert not model.training and not model[1].training


def test_outputs_that_alias_each_other_or_state_are_those_tensors():
    lin = nn.Linear(2, 2).to("jax")
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)

    @t2j.jit
    def f(x):
        y = x * 2
        return y, y, y.view(2, 2)

    @t2j.jit
    def step(x):
        opt.zero_grad()
        lin(x).sum().backward()
        opt.step()
        return lin.weight.grad, opt.state[lin.weight]["exp_avg"]

    for _ in range(3):
        a, b, c = f(torch.arange(4.0, device="jax"))
        a.add_(100)
        assert a is b and c.tolist() == [[100.0, 102.0], [104.0, 106.0]]
        grad, exp_avg = step(torch.ones(3, 2, device="jax"))
        assert grad is lin.weight.grad and exp_avg is opt.state[lin.weight]["exp_avg"]


class _Ring:
    def __init__(self):
        self.items, self.ptr, self.count = [None] * 3, 0, 0

    def push(self, t):
        self.items[self.ptr] = t
        self.ptr = (self.ptr + 1) % 3
        self.count += 1


def test_state_a_method_of_a_reached_object_changes_is_replayed():
    def run(device, jit):
        ring = _Ring()

        def f(x):
            ring.push(x * 2)
            return sum(t for t in ring.items if t is not None)

        g = t2j.jit(f) if jit else f
        sums = [g(torch.full((2,), float(i + 1), device=device)).cpu().tolist() for i in range(5)]
        return sums, ring.ptr, ring.count

    assert run("jax", True) == run("cpu", False)


def test_zero_grad_clears_the_grad_of_a_parameter_frozen_since():
    # a parameter frozen after a step keeps its .grad until zero_grad() sets it to None, in the
    # program cached for the frozen layout too
    def run(device):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).to(device)
        step = _train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), lambda model, x: model(x).pow(2).sum())
        f = t2j.jit(step) if device == "jax" else step
        grads = []
        for i in range(5):
            m[0].weight.requires_grad_(i % 2 == 0)
            f(torch.ones(2, 3, device=device))
            grads.append(None if m[0].weight.grad is None else m[0].weight.grad.cpu())
        return grads, getattr(f, "stats", None)

    (want, _), (got, stats) = run("cpu"), run("jax")
    assert [g is None for g in got] == [g is None for g in want] == [False, True, False, True, False]
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a, b)
    assert stats["hits"] == 2


def test_tuples_lists_and_dicts_of_tensors_stored_in_places_are_stored_by_every_call():
    # an RNN's carried ``self.hidden = (h, c)``, a dict of tensors and numbers, a plain object's list
    class Carry(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden, self.stats = None, {}

        def forward(self, x):
            if self.hidden is None:
                self.hidden = (torch.zeros_like(x), torch.zeros_like(x))
            self.hidden = (self.hidden[0] + x, self.hidden[1] + 2 * x)
            self.stats = {"h": [self.hidden[0] * 1, x.sum().item()]}
            return self.hidden[0] + self.hidden[1]

    class Holder:
        pair = None

    def run(wrap, device):
        m, holder = Carry(), Holder()
        x = torch.ones(1, device=device)

        def f(x):
            out = m(x)
            holder.pair = [out * 10, (out,)]
            return out

        g = wrap(f)
        got = [(g(x).item(), m.hidden[0].item(), m.stats["h"][0].item(), m.stats["h"][1], holder.pair[0].item(),
                holder.pair[1][0].item(), type(m.hidden).__name__) for _ in range(5)]
        return got, g

    expected, _ = run(lambda f: f, "cpu")
    got, g = run(t2j.jit, "jax")
    assert got == expected
    assert g.stats["traces"] == 2  # (no hidden state, then a tuple of it)


def test_argument_views_at_new_offsets_reuse_the_program():
    """Minibatches sliced from a dataset held on the device (truncated BPTT's ``data[:, i:i + k]``):
    the function only reads them, so a new storage offset does not trace again."""
    w = torch.linspace(-1, 1, 8, device="jax", requires_grad=True)

    def loss(x, y):
        return ((x.float() * w).sum(1) - y.float().sum(1)).square().mean()

    step = t2j.jit(loss)
    data = torch.arange(200, device="jax").view(2, 100)
    for i in range(0, 80, 8):
        x, y = data[:, i:i + 8], data[:, i + 1:i + 9]
        assert step(x, y).item() == pytest.approx(loss(x, y).item())
    assert step.stats["traces"] == 1  # (the first call too passes copies of the views: one program)


def test_argument_views_that_require_grad_at_new_offsets_reuse_the_program():
    # ``step(xs[i])`` with xs a leaf: each offset traced a program of its own
    def run(device, wrap):
        torch.manual_seed(0)
        xs = torch.randn(6, 4).to(device).requires_grad_()
        w = torch.linspace(-1, 1, 4, device=device, requires_grad=True)
        f = wrap(lambda x: (x * w).square().sum())
        losses = [f(xs[i]) for i in range(5)]
        sum(losses).backward()
        return [v.item() for v in losses], xs.grad.cpu(), w.grad.cpu(), f

    expected, got = run("cpu", lambda f: f), run("jax", t2j.jit)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    torch.testing.assert_close(got[1], expected[1])
    torch.testing.assert_close(got[2], expected[2])
    assert got[3].stats["traces"] <= 2 and got[3].stats["hits"] >= 3
    # one written in place stays a view: torch refuses it, as for the view itself
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        t2j.jit(lambda x: x.mul_(2))(torch.ones(3, 2, device="jax", requires_grad=True)[1])


def test_argument_views_written_or_returned_stay_views():
    def scale(x):
        x.mul_(2)
        return x, x[0]

    f = t2j.jit(scale)
    data, expected = torch.arange(20.0, device="jax"), torch.arange(20.0)
    for i in range(0, 16, 4):
        view = data[i:i + 4]
        out, first = f(view)
        scale(expected[i:i + 4])
        assert out is view and first._base is data and first.storage_offset() == i
    assert data.cpu().tolist() == expected.tolist()


class _WrappingOptimizer(torch.optim.Optimizer):
    """A wrapper holding its base optimizer's param_groups (SAM, Lookahead-style wrappers)."""

    def __init__(self, params, **kw):
        super().__init__(params, dict(kw))
        self.base = torch.optim.SGD(self.param_groups, **kw)
        self.param_groups = self.base.param_groups

    def step(self):
        self.base.step()


@pytest.mark.parametrize("program", ["shared_groups", "lr_set_inside", "warmup_inside"])
def test_hyperparameters_a_step_shares_or_sets_itself(program):
    def run(device, wrap):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 2).to(device)
        opt = (_WrappingOptimizer if program == "shared_groups" else torch.optim.SGD)(lin.parameters(), lr=0.1)

        def step(x, i):
            if program == "lr_set_inside":
                for g in opt.param_groups:
                    g["lr"] = 0.01 * (i + 1)
            elif program == "warmup_inside":
                for g in opt.param_groups:
                    g["lr"] = 0.1 * min(1.0, (i + 1) / 3)
            loss = lin(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        f = wrap(step)
        x = torch.linspace(-1, 1, 12, device=device).view(3, 4)
        losses = [f(x, i).item() for i in range(5)]
        return losses, opt.param_groups[0]["lr"], getattr(f, "stats", None)

    expected, lr, _ = run("cpu", lambda f: f)
    got, got_lr, stats = run("jax", t2j.jit)
    assert got == pytest.approx(expected, rel=1e-5) and got_lr == pytest.approx(lr) and type(got_lr) is float
    assert stats["compiles"] <= 2 and stats["eager_calls"] == 0


@pytest.mark.parametrize("then", ["advance_a_counter", "graph_break"])
def test_data_assignment_in_a_trace_that_stops_is_undone(then):
    """A momentum encoder (MoCo, BYOL) rebinds its parameters with ``p.data = ...``; a trace that then
    stops (a Python number to lift, a value-dependent op) must leave them bound as they were."""
    def run(device, wrap):
        torch.manual_seed(0)
        q, k = torch.nn.Linear(3, 2).to(device), torch.nn.Linear(3, 2).to(device).requires_grad_(False)
        opt = torch.optim.SGD(q.parameters(), lr=0.1)
        state, ptr = {"n": 0}, torch.zeros(1, dtype=torch.long, device=device)

        def step(x):
            with torch.no_grad():
                for pk, pq in zip(k.parameters(), q.parameters()):
                    pk.data = pk.data * 0.9 + pq.data * 0.1
            loss = (q(x) - k(x)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if then == "advance_a_counter":
                state["n"] += 1
            else:
                int(ptr)
            return loss

        f = wrap(step)
        x = torch.linspace(-1, 1, 12, device=device).view(4, 3)
        return [f(x).item() for _ in range(4)] + [k.weight.sum().item(), state["n"]]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run("jax", t2j.jit) == pytest.approx(run("cpu", lambda f: f), rel=1e-5)


def test_outputs_made_under_inference_mode_are_inference_tensors():
    lin = torch.nn.Linear(3, 2).to("jax")

    def predict(x):
        with torch.inference_mode():
            y = lin(x)
        return y, y.t(), lin(x)

    x = torch.randn(4, 3, device="jax")
    f = t2j.jit(predict)
    for _ in range(2):
        got, expected = f(x), predict(x)
        assert [t.is_inference() for t in got] == [t.is_inference() for t in expected] == [True, True, False]
        with pytest.raises(RuntimeError, match="inference"):
            got[0].requires_grad_()


@pytest.mark.parametrize("make", ["detach", "data", "detach_slice", "no_grad_slice", "slice", "parameter_detach"])
def test_view_outputs_keep_their_relation_to_autograd(make):
    """A returned ``x.detach()`` / ``x.data`` of an input that requires grad is detached, a view made
    under no_grad has no history, a plain slice has one, as in torch."""
    lin = torch.nn.Linear(3, 3)

    def out(x):
        if make == "detach":
            return x.detach()
        if make == "data":
            return x.data
        if make == "detach_slice":
            return x.detach()[1:]
        if make == "no_grad_slice":
            with torch.no_grad():
                return x[1:]
        if make == "parameter_detach":
            return lin.weight.detach()
        return x[1:]

    def run(device, wrap):
        lin.to(device)
        w = torch.ones(3, device=device, requires_grad=True)
        f = wrap(out)
        got = []
        for _ in range(2):
            y = f(w)
            got.append((y.requires_grad, y.grad_fn is None, y.is_leaf, y._base is None))
            if y.grad_fn is not None:
                y.sum().backward()
        got.append(None if w.grad is None else w.grad.cpu().tolist())
        return got

    assert run("jax", t2j.jit) == run("cpu", lambda f: f)


def test_value_view_outputs_of_inputs_are_views():
    """``x.imag``, ``view_as_real``, ``conj`` and dtype views of an input come back as those views,
    so writes through them reach the input and gradients flow, as torch returns them."""
    def run(device, wrap):
        got = []
        for _ in range(2):  # the trace, then the compiled program
            z = torch.zeros(2, 3, dtype=torch.complex64, device=device)
            imag = wrap(lambda t: t.imag)(z)
            imag.fill_(5)
            wrap(lambda t: torch.view_as_real(t))(z)[..., 0] = 1
            conj = wrap(lambda t: t.conj())(z)
            sliced = wrap(lambda t: t[:, 1:].imag)(z)
            row = wrap(lambda t: t.unbind(0)[1].imag)(z)
            x = torch.zeros(2, device=device)
            wrap(lambda t: t.view(torch.int32))(x).fill_(1)
            w = torch.ones(3, dtype=torch.complex64, device=device, requires_grad=True)
            wrap(lambda t: t.conj() * 2)(w).abs().sum().backward()
            got.append((z.cpu().tolist(), imag._base is z, conj.is_conj(), x.cpu().tolist(), sliced.stride(),
                        sliced.storage_offset(), row.stride(), row.storage_offset(), w.grad.cpu().tolist()))
        return got

    assert run("jax", t2j.jit) == run("cpu", lambda f: f)


def test_each_state_tensor_is_one_slot():
    """Parameters and buffers are slots once: the walk for tensors a module holds in plain
    attributes (and in tuples, lists and dicts of them) skips its own parameter and buffer dicts."""
    jit = sys.modules["torch2jax.jit"]
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).to("jax")
    m.carried = (torch.zeros(2, device="jax"), [torch.ones(1, device="jax")])
    opt = torch.optim.AdamW(m.parameters())

    def step(x):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()

    x = torch.randn(5, 4, device="jax")
    step(x)
    roots = jit._find_roots(step, (x,), {})
    tensors = [t for t in jit._collect([x], roots, full=True).tensors if t is not None]
    assert len(tensors) == len({id(t) for t in tensors})
    assert sorted(map(id, roots.tensors)) == sorted(map(id, [m.carried[0], m.carried[1][0]]))


def test_gradients_and_flags_the_function_gives_its_argument_tensors_reach_each_calls_arguments():
    """A cached call sets ``.grad`` / ``requires_grad`` on the tensors it is given, not on the
    traced call's, each ``.grad`` a tensor of its own; one tensor passed again accumulates."""

    def backward_into(x):
        (x * x).sum().backward()

    def assign(x):
        x.grad = x * 2

    def flag(x):
        x.requires_grad_()
        return x * 1

    results = {}
    for device in ("cpu", "jax"):
        run = [backward_into, assign, flag] if device == "cpu" else [t2j.jit(f) for f in (backward_into, assign, flag)]
        xs = [torch.full((2,), float(i + 1), device=device, requires_grad=True) for i in range(3)]
        ys = [torch.full((2,), float(i + 1), device=device) for i in range(3)]
        zs = [torch.ones(2, device=device) for _ in range(3)]
        for x, y, z in zip(xs, ys, zs):
            run[0](x)
            run[1](y)
            run[2](z)
        again = torch.ones(2, device=device, requires_grad=True)
        for _ in range(3):
            run[0](again)
        assert len({id(x.grad) for x in xs}) == 3
        results[device] = ([x.grad.tolist() for x in xs], [y.grad.tolist() for y in ys],
                           [z.requires_grad for z in zs], again.grad.tolist())
    assert results["jax"] == results["cpu"]


def test_a_dense_argument_in_another_memory_order_keeps_its_strides():
    # channels_last or transposed arguments: the trace sees their strides (a branch on
    # is_contiguous(), a conv's channels_last result) and a call in another order traces again
    x = torch.randn(2, 3, 4, 4)
    conv = nn.Conv2d(3, 4, 1)
    conv_jax = copy.deepcopy(conv).to("jax")

    def f(x, conv):
        return x.is_contiguous(), x.stride(), conv(x) * 2

    run = t2j.jit(lambda x: f(x, conv_jax))
    for layout in (x, x.to(memory_format=torch.channels_last), x, x.to(memory_format=torch.channels_last),
                   x.transpose(2, 3)):
        flag, stride, y = run(layout.to("jax"))
        expected = f(layout, conv)
        assert (flag, stride) == expected[:2]
        assert y.stride() == expected[2].stride()
        torch.testing.assert_close(y.cpu(), expected[2].detach())


@pytest.mark.parametrize("view_first", [False, True])
def test_an_output_that_views_another_output_is_that_view_in_either_order(view_first):
    # (t, t[:, :2]) and (t[:, :2], t): a write to t shows in the view, as in torch
    def f(x):
        t = x * 2
        return (t[:, 1:3], t) if view_first else (t, t[:, 1:3])

    run = t2j.jit(f)
    for call in range(2):
        out = run(torch.arange(12.0, device="jax").reshape(3, 4))
        view, t = out if view_first else out[::-1]
        expected_view, expected_t = (f(torch.arange(12.0).reshape(3, 4)) if view_first
                                     else f(torch.arange(12.0).reshape(3, 4))[::-1])
        t.add_(1)
        expected_t.add_(1)
        assert view.stride() == expected_view.stride() and view.storage_offset() == expected_view.storage_offset()
        assert view.tolist() == expected_view.tolist()


_FORWARD_SCALE = 2.0


class _ScaledByAGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x) * _FORWARD_SCALE


def test_a_global_read_by_a_module_s_forward_is_guarded():
    # as the jitted function's own globals: a new value traces again (was: frozen into the program)
    global _FORWARD_SCALE
    model = _ScaledByAGlobal().to("jax")
    run = t2j.jit(lambda x: model(x) + 1)
    x = torch.ones(1, 2, device="jax")
    try:
        for scale in (2.0, 3.0, 3.0):
            _FORWARD_SCALE = scale
            torch.testing.assert_close(run(x).cpu(), (model(x) + 1).detach().cpu())
    finally:
        _FORWARD_SCALE = 2.0
    assert run.stats["traces"] == 2


def _scale_three_deep(x):
    return _scale_two_deep(x)


def _scale_two_deep(x):
    return _scale_one_deep(x)


def _scale_one_deep(x):
    return x * _FORWARD_SCALE


class _ScaledInAMethod(nn.Module):
    """Reads the global through its own method, a static method, an inherited one, a plain helper
    object's method, and helpers three calls deep."""

    def __init__(self):
        super().__init__()
        self.helper = _ScalingHelper()

    def scale(self, x):
        return x * _FORWARD_SCALE

    @staticmethod
    def shift(x):
        return x + _FORWARD_SCALE

    def forward(self, x):
        return torch.stack([self.scale(x), self.shift(x), self.core(x), self.helper.apply(x), _scale_three_deep(x)])


class _ScalingHelper:
    def apply(self, x):
        return x - _FORWARD_SCALE


class _ScaledInAMethodSub(_ScaledInAMethod):
    def core(self, x):
        return x / _FORWARD_SCALE


def test_a_global_read_by_a_module_s_methods_is_guarded():
    # was: only forward and the plain functions it names two calls deep were read, so a global read
    # in ``self.helper(x)`` stayed frozen into the program at its first value
    global _FORWARD_SCALE
    model = _ScaledInAMethodSub()
    run = t2j.jit(model)
    x = torch.ones(2, device="jax")
    try:
        for scale in (2.0, 3.0, 3.0):
            _FORWARD_SCALE = scale
            torch.testing.assert_close(run(x).cpu(), model(x).cpu())
    finally:
        _FORWARD_SCALE = 2.0
    assert run.stats["traces"] == 2


_SCALING_HELPER = _ScalingHelper()


def test_a_global_read_by_a_helper_object_s_method_is_guarded():
    # a jitted function calling a method of a global or closed-over plain object: the method's globals
    # are the function's (was: frozen into the program at their first values)
    global _FORWARD_SCALE
    local = _ScalingHelper()
    run = t2j.jit(lambda x: _SCALING_HELPER.apply(x) * local.apply(x))
    x = torch.ones(2, device="jax")
    try:
        for scale in (2.0, 3.0, 3.0):
            _FORWARD_SCALE = scale
            assert run(x).tolist() == [(1 - scale) ** 2] * 2
    finally:
        _FORWARD_SCALE = 2.0
    assert run.stats["traces"] == 2


@pytest.mark.parametrize("make", [lambda base: base.t(), lambda base: base.permute(1, 0)])
def test_writes_into_a_permuted_argument_reach_its_base_on_every_call(make):
    # a dense view in another order is copied in its layout where the function only reads it;
    # one that writes it gets the view itself on every call
    def f(x):
        x.add_(1)

    run = t2j.jit(f)
    base, expected = torch.zeros(4, 3, device="jax"), torch.zeros(4, 3)
    for _ in range(3):
        run(make(base))
        f(make(expected))
    assert base.cpu().tolist() == expected.tolist()
    image = torch.randn(2, 3, 4, 4)
    on_jax, on_cpu = image.to("jax").to(memory_format=torch.channels_last), image.to(memory_format=torch.channels_last)
    relu = t2j.jit(lambda x: x.relu_().mul_(2))
    for _ in range(3):
        relu(on_jax)
        on_cpu.relu_().mul_(2)
    torch.testing.assert_close(on_jax.cpu(), on_cpu)


def test_in_place_writes_to_a_cpu_tensor_argument_reach_it():
    # a CPU tensor argument is copied to the device for the program: what the call writes into
    # the copy is copied back, through a view into its base too (was: silently dropped)
    def f(x):
        x.mul_(2).add_(1)
        return x.sum()

    run = t2j.jit(f)
    x, expected = torch.zeros(3), torch.zeros(3)
    base, expected_base = torch.zeros(2, 3), torch.zeros(2, 3)
    for _ in range(3):
        assert run(x).item() == f(expected).item()
        run(base[0])
        f(expected_base[0])
    assert x.tolist() == expected.tolist() and base.tolist() == expected_base.tolist()
    unchanged = torch.ones(3)
    t2j.jit(lambda z: z * 2)(unchanged)
    assert unchanged.tolist() == [1.0, 1.0, 1.0]


def _grads_pair():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = copy.deepcopy(ref).to("jax")
    return ref, model


def test_forward_keeps_its_program_when_a_backward_outside_creates_grads():
    # the gradients are no state of a function that never touches them: the backward outside the
    # jitted forward gives the parameters a .grad, an optimizer steps them, and the program stays
    ref, model = _grads_pair()
    forward = t2j.jit(lambda x: model(x))
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.1) for m in (model, ref))
    for i in range(4):
        x = torch.randn(3, 4)
        loss, ref_loss = forward(x.to("jax")).pow(2).sum(), ref(x).pow(2).sum()
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        if i == 2:  # (zero_grad: the gradients are dropped again)
            opt.zero_grad()
            ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    assert forward.stats["traces"] == 1 and forward.stats["hits"] == 3


def test_compiled_module_traces_once_across_training_steps():
    ref, model = _grads_pair()
    compiled = t2j.compile(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    for _ in range(3):
        x = torch.randn(5, 4)
        for m, o, inp in ((compiled, opt, x.to("jax")), (ref, ref_opt, x)):
            o.zero_grad()
            m(inp).pow(2).mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    assert compiled._forward.stats["traces"] == 1


_GRAD = "gr" + "ad"  # (read with getattr: no name in the function's code says it reads gradients)


def test_a_forward_reading_grads_unseen_by_name_carries_them():
    _, model = _grads_pair()

    def f(x):
        g = getattr(model[0].weight, _GRAD)
        return model(x).sum() + (0.0 if g is None else g.sum())

    jitted = t2j.jit(f)
    x = torch.ones(2, 4, device="jax")
    torch.testing.assert_close(jitted(x), f(x))
    model(x).sum().backward()
    torch.testing.assert_close(jitted(x), f(x))  # (the gradient now read: a new program, not the stale one)
    assert any("reads or writes a .grad" in m for m in t2j.explain_recompiles())


def test_a_backward_unseen_by_name_accumulates_into_grads():
    ref, model = _grads_pair()

    def step(m, x):
        loss = m(x).pow(2).sum()
        getattr(loss, "back" + "ward")()
        return loss

    jitted = t2j.jit(functools.partial(step, model))
    for _ in range(3):
        x = torch.randn(3, 4)
        torch.testing.assert_close(jitted(x.to("jax")).detach().cpu(), step(ref, x).detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)


def test_a_training_steps_first_program_is_compiled_for_one_run(monkeypatch):
    # its first call creates .grad and the optimizer state, so its next call has a program of its own
    jit_module = sys.modules["torch2jax.jit"]
    once = []
    real = jit_module._compiled_once
    monkeypatch.setattr(jit_module, "_compiled_once", lambda *a: once.append(1) or real(*a))
    ref, model = _grads_pair()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, ref))
    mse = lambda m, x, y: F.mse_loss(m(x), y)  # noqa: E731
    step, ref_step = (_train_step(m, o, mse) for m, o in ((model, opt), (ref, ref_opt)))
    jitted = t2j.jit(step)
    forward = t2j.jit(lambda x: model(x))
    for _ in range(3):
        x, y = torch.randn(6, 4), torch.randn(6, 2)
        torch.testing.assert_close(jitted(x.to("jax"), y.to("jax")).detach().cpu(), ref_step(x, y).detach(),
                                   rtol=1e-5, atol=1e-6)
        forward(x.to("jax"))
    assert once == [1] and jitted.stats["compiles"] == 2


def test_default_dtype_is_part_of_the_cache_key():
    f = t2j.jit(lambda x: (x / 2, torch.ones(2, device=x.device)))
    x = torch.arange(4, device="jax")
    assert [t.dtype for t in f(x)] == [torch.float32] * 2
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert [t.dtype for t in f(x)] == [torch.float64] * 2
    finally:
        torch.set_default_dtype(before)
    assert any("default dtype" in m for m in t2j.explain_recompiles())


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop])
def test_optimizer_step_counters_are_float64_under_a_float64_default(opt_cls):
    # (t2j.jit steps Adam on torch's fused path, whose counters torch makes float32)
    def run(device, jit):
        torch.manual_seed(0)
        m = nn.Linear(3, 2).to(device)
        opt = opt_cls(m.parameters(), lr=1e-2)
        x = torch.randn(4, 3).to(device)

        def step(x):
            opt.zero_grad()
            loss = m(x).pow(2).sum()
            loss.backward()
            opt.step()
            return loss

        f = t2j.jit(step) if jit else step
        losses = [f(x).item() for _ in range(3)]
        return losses, {k: v.dtype for k, v in opt.state[m.weight].items()}, getattr(f, "stats", None)

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        (want, want_dtypes, _), (got, got_dtypes, stats) = run("cpu", False), run("jax", True)
    finally:
        torch.set_default_dtype(before)
    assert got == pytest.approx(want, rel=1e-12)
    assert got_dtypes == want_dtypes and want_dtypes["step"] == torch.float64
    assert stats["traces"] == 2


@pytest.mark.parametrize("op", [torch.exp, torch.sigmoid, torch.tanh])
def test_returning_an_output_its_op_saved_after_a_backward_inside(op):
    # (exp, sigmoid and tanh save their own output: reading a freed node's saved result raised, and the
    # step ran eagerly on every call)
    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    wj = w.detach().to("jax").requires_grad_()

    def step(w, x):
        y = op(x * w)
        y.sum().backward()
        return y

    jitted = t2j.jit(step)
    for _ in range(2):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(wj, x.to("jax")).detach().cpu(), step(w, x).detach())
    torch.testing.assert_close(wj.grad.cpu(), w.grad)
    assert jitted.stats["eager_calls"] == 0 and jitted.stats["compiles"] >= 1


def test_cpu_table_indexed_by_a_counter_compiles_once():
    # a scheduler's ``self.sigmas[self.step_index]`` with the table on the CPU (diffusers keeps it there)
    class Scheduler:
        def __init__(self):
            self.step_index = 0
            self.sigmas = torch.linspace(1.0, 0.0, 11)

    def denoise(sched, x):
        y = x * sched.sigmas[sched.step_index]
        sched.step_index += 1
        return y

    ref, sched = Scheduler(), Scheduler()
    jitted = t2j.jit(functools.partial(denoise, sched))
    for _ in range(6):
        x = torch.randn(4)
        torch.testing.assert_close(jitted(x.to("jax")).cpu(), denoise(ref, x))
    assert sched.step_index == 6 and jitted.stats["compiles"] == 1


@pytest.mark.parametrize("kind", ["channels_last", "minibatch view"])
def test_view_arguments_run_one_program_from_the_first_call(kind):
    conv = nn.Conv2d(3, 4, 3).to("jax")
    data = torch.randn(12, 3, 8, 8, device="jax")
    jitted = t2j.jit(lambda x: conv(x).sum((1, 2, 3)))
    for i in range(3):
        x = data[i * 4:(i + 1) * 4] if kind == "minibatch view" else \
            data[i * 4:(i + 1) * 4].contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(jitted(x), conv(x).sum((1, 2, 3)))
    assert jitted.stats["traces"] == 1, t2j.explain_recompiles()


@pytest.mark.parametrize("read", ["as_strided", "as_strided at an offset", "untyped_storage"])
def test_a_view_argument_read_through_its_storage_is_the_view_itself(read):
    # a view argument the function only reads is passed as a copy, unless it reads storage the copy lacks
    fn = {
        "as_strided": lambda x: x.as_strided((2, 2), (1, 1)) * 1,
        "as_strided at an offset": lambda x: torch.as_strided(x, (2, 2), (6, 1), 7) * 1,
        "untyped_storage": lambda x: x.new_empty(0).set_(x.untyped_storage(), 7, (2, 2), (6, 1)) * 1,
    }[read]
    base = torch.arange(18.0).reshape(3, 6)
    jitted, on_device = t2j.jit(fn, fullgraph=read != "untyped_storage"), base.to("jax")
    for _ in range(2):
        torch.testing.assert_close(jitted(on_device[1:, ::2]).cpu(), fn(base[1:, ::2]))


def test_a_list_or_dict_argument_the_function_changes_is_changed():
    def f(x, log, metrics):
        log.append(x.sum().item())
        metrics["y"] = x + 1
        return x * 2

    jitted = t2j.jit(f, fullgraph=True)
    for i in range(3):
        log, metrics = [float(i)], {"n": i}
        out = jitted(torch.full((2,), float(i), device="jax"), log, metrics)
        assert log == [float(i), 2.0 * i] and list(metrics) == ["n", "y"] and metrics["n"] == i
        torch.testing.assert_close(metrics["y"].cpu(), torch.full((2,), i + 1.0))
        torch.testing.assert_close(out.cpu(), torch.full((2,), 2.0 * i))
    assert jitted.stats["eager_calls"] == 0


def test_a_batch_the_step_pops_its_labels_from_is_one_program():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    on_device = copy.deepcopy(model).to("jax")

    def step(m, batch):
        labels = batch.pop("labels")
        return F.cross_entropy(m(**batch), labels)

    jitted = t2j.jit(step, fullgraph=True)
    for i in range(3):
        x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        batch, ours = {"input": x, "labels": y}, {"input": x.to("jax"), "labels": y.to("jax")}
        torch.testing.assert_close(jitted(on_device, ours).cpu(), step(model, batch))
        assert list(ours) == list(batch) == ["input"] and ours["input"].device.type == "jax"
    assert jitted.stats["traces"] == 1


def _word_tokenizer():
    """A real fast tokenizer built offline: its batches are ``BatchEncoding`` objects holding ``Encoding``s."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "a", "b", "c", "d"])}
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="[PAD]")


def test_a_batch_encoding_the_step_pops_its_labels_from_is_one_program():
    torch.manual_seed(0)
    tokenizer = _word_tokenizer()
    model = nn.Embedding(6, 3)
    on_device = copy.deepcopy(model).to("jax")

    def step(m, batch):
        labels = batch.pop("labels")
        return F.cross_entropy(m(batch["input_ids"]).mean(1), labels), batch

    jitted = t2j.jit(step, fullgraph=True)
    for text in (["a b c", "d a"], ["b b", "c d a"], ["d c b", "a"]):
        batch = tokenizer(text, padding=True, return_tensors="pt")
        assert batch.encodings is not None  # (new Encoding objects every batch: still one program)
        batch["labels"] = torch.tensor([0, 2])
        ours = batch.copy()
        ours.data = {k: v.to("jax") for k, v in batch.items()}
        ours._encodings = batch.encodings
        loss, returned = jitted(on_device, ours)
        expected, _ = step(model, batch)
        torch.testing.assert_close(loss.cpu(), expected)
        assert type(ours) is type(batch) and list(ours) == list(batch) == ["input_ids", "attention_mask"]
        assert returned is ours
    assert jitted.stats["traces"] == 1


def test_a_dict_subclass_argument_keeps_its_class_and_attributes():
    class Batch(dict):
        pass

    def f(batch):
        batch["y"] = batch.pop("x") * batch.scale
        return batch

    jitted = t2j.jit(f, fullgraph=True)
    for i in range(3):
        batch = Batch(x=torch.full((2,), float(i), device="jax"))
        batch.scale = 3
        out = jitted(batch)
        assert out is batch and out.scale == 3 and list(batch) == ["y"]
        torch.testing.assert_close(batch["y"].cpu(), torch.full((2,), 3.0 * i))
    assert jitted.stats["traces"] == 1


class _PlainBatch:
    def __init__(self, x, scale=1.0):
        self.x, self.scale, self.logits = x, scale, None


@dataclasses.dataclass
class _DataclassBatch:
    x: torch.Tensor
    scale: float = 1.0
    logits: object = None


class _SlotsBatch:
    __slots__ = ("x", "scale", "logits")

    def __init__(self, x, scale=1.0):
        self.x, self.scale, self.logits = x, scale, None


@dataclasses.dataclass(slots=True)
class _SlotsDataclassBatch:
    x: torch.Tensor
    scale: float = 1.0
    logits: object = None


# (classes with __slots__ hold no __dict__: they were one program per object)
@pytest.mark.parametrize("Batch", [_DataclassBatch, _PlainBatch, _SlotsBatch, _SlotsDataclassBatch],
                         ids=["dataclass", "plain class", "slots class", "slots dataclass"])
def test_a_batch_object_made_for_each_call_is_one_program(Batch):
    lin = nn.Linear(3, 2).to("jax")

    @t2j.jit
    def step(batch):
        batch.logits = lin(batch.x) * batch.scale
        batch.x.mul_(2)
        return batch, batch.logits.sum()

    batches = [Batch(torch.full((2, 3), float(i), device="jax")) for i in range(4)]  # (all alive: no id reused)
    for i, batch in enumerate(batches):
        out, total = step(batch)
        expected = lin(torch.full((2, 3), float(i), device="jax"))
        assert out is batch and torch.equal(batch.logits, expected) and torch.equal(total, expected.sum())
        assert batch.x.eq(2.0 * i).all()
    assert step.stats["traces"] == 1


@pytest.mark.parametrize("change", ["pop first", "insert", "nested", "reorder", "tuple of lists", "delete"])
def test_argument_containers_changed_in_place_as_in_torch(change):
    def f(x, tree):
        if change == "pop first":
            tree["hist"].pop(0)
            tree["hist"].append(x * 2)
        elif change == "insert":
            tree["hist"].insert(1, x.sum())
        elif change == "nested":
            tree["inner"]["z"] = tree["inner"].pop("w") + x
            tree["hist"].reverse()
        elif change == "reorder":
            tree["inner"]["w"] = tree["inner"].pop("w")
        elif change == "tuple of lists":
            tree["pair"][0].append(tree["pair"][1].pop())
        else:
            del tree["hist"][0], tree["inner"]
        return x + 1

    def make(dev):
        hist = [torch.full((2,), float(k), device=dev) for k in range(3)]
        pair = ([torch.ones(2, device=dev)], [torch.zeros(2, device=dev), 7])
        return {"hist": hist, "inner": {"w": torch.arange(2.0, device=dev), "k": 3}, "pair": pair}

    jitted = t2j.jit(f, fullgraph=True)
    for i in range(2):
        x = torch.full((2,), float(i))
        expected, tree = make("cpu"), make("jax")
        torch.testing.assert_close(jitted(x.to("jax"), tree).cpu(), f(x, expected))
        got = torch_pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)
        assert torch_pytree.tree_structure(got) == torch_pytree.tree_structure(expected)
        torch.testing.assert_close(got, expected)
    assert jitted.stats["traces"] == 1


def test_an_argument_container_moved_into_another_runs_eagerly():
    def f(x, a, b):
        b.append(a)
        a.append(x * 2)
        return x

    jitted = t2j.jit(f)
    a, b = [], []
    with pytest.warns(UserWarning, match="changed a list or dict it was passed in a way"):
        jitted(torch.ones(2, device="jax"), a, b)
    assert b[0] is a and a[0].sum().item() == 4.0


def test_a_size_argument_is_no_container_the_function_changes():
    jitted = t2j.jit(lambda x, size: x.reshape(size) * 2, fullgraph=True)
    assert jitted(torch.ones(6, device="jax"), torch.Size([2, 3])).shape == (2, 3)


def test_an_argument_bound_to_another_tensors_values_is_bound_on_every_call():
    def f(x, z):
        x.data = z * 3
        return x.sum()

    jitted = t2j.jit(f)
    for i in range(3):
        x, z = torch.zeros(3, device="jax"), torch.full((3,), float(i), device="jax")
        with pytest.warns(UserWarning, match="binds the tensor it was given") if i == 0 else contextlib.nullcontext():
            assert jitted(x, z).item() == 9.0 * i
        torch.testing.assert_close(x.cpu(), torch.full((3,), 3.0 * i))


def test_a_returned_learning_rate_is_the_python_number_it_is():
    model = nn.Linear(4, 2).to("jax")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

    @t2j.jit
    def step(x):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        return {"lr": opt.param_groups[0]["lr"]}

    for expected in (0.1, 0.05, 0.025):
        lr = step(torch.randn(8, 4, device="jax"))["lr"]
        assert type(lr) is float and lr == expected
        schedule.step()


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.Adam(p, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, fused=True)], ids=["Adam", "fused AdamW", "fused SGD"])
def test_a_learning_rate_set_inside_the_step_from_an_argument_compiles_once(make):
    # the fused steps take lr as a Python float: the program's lr goes to their tensor-lr overloads
    torch.manual_seed(0)
    model, x = nn.Linear(4, 2), torch.randn(8, 4)
    on_device = copy.deepcopy(model).to("jax")

    def make_step(m, opt, inputs):
        def step(lr):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad()
            loss = m(inputs).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        return step

    step = make_step(model, make(model.parameters()), x)
    jitted = t2j.jit(make_step(on_device, make(on_device.parameters()), x.to("jax")))
    for i in range(5):
        torch.testing.assert_close(jitted(0.01 / (1 + i)).cpu(), step(0.01 / (1 + i)))
    for p, q in zip(model.parameters(), on_device.parameters()):
        torch.testing.assert_close(q.cpu(), p)
    assert jitted.stats["traces"] == 2, t2j.explain_recompiles()


def test_a_dict_holding_the_hidden_state_between_steps_warns_of_nothing():
    # truncated BPTT: ``state["h"]`` goes from None to the detached (h, c), stored again by every call
    torch.manual_seed(0)
    rnn, seq = nn.LSTM(4, 5, batch_first=True), torch.randn(2, 17, 4)

    def make_step(lstm, state):
        def step(x):
            out, hc = lstm(x, state["h"])
            state["h"] = tuple(t.detach() for t in hc)
            return out.sum()

        return step

    state, on_device = {"h": None}, {"h": None}
    step, jitted = make_step(rnn, state), t2j.jit(make_step(copy.deepcopy(rnn).to("jax"), on_device))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(0, 16, 4):
            torch.testing.assert_close(jitted(seq[:, i:i + 4].to("jax")).cpu(), step(seq[:, i:i + 4]))
    torch.testing.assert_close(on_device["h"][0].cpu(), state["h"][0])
    assert jitted.stats["traces"] == 2, t2j.explain_recompiles()


def test_sizes_from_tensor_values_stop_the_trace_with_a_reason():
    def f(x, hw):
        return F.interpolate(x, size=(hw[0], hw[1]), mode="bilinear", align_corners=True)

    x, hw = torch.randn(1, 4, 4, 4), torch.tensor([3, 2])
    with pytest.warns(UserWarning, match="a size computed from a tensor's values"):
        torch.testing.assert_close(t2j.jit(f)(x.to("jax"), hw.to("jax")).cpu(), f(x, hw))
    with pytest.raises(RuntimeError, match="a size computed from a tensor's values"):
        t2j.jit(f, fullgraph=True)(x.to("jax"), hw.to("jax"))


class _CountingSGD(torch.optim.Optimizer):
    """A hand-written optimizer keeping its step count as a Python int in its state, with a decaying step size."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                p.add_(p.grad, alpha=-group["lr"] * math.pow(state["step"], -0.5))


@pytest.mark.parametrize("make", ["counting_sgd", "adafactor"])
def test_a_python_number_in_optimizer_state_becomes_a_program_input(make):
    # it retraced on every call, each step count a program of its own
    def optimizer(params):
        if make == "counting_sgd":
            return _CountingSGD(params, lr=0.1)
        transformers = pytest.importorskip("transformers")
        return transformers.Adafactor(params, lr=None)  # relative_step: lr from state["step"] and the RMS

    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    model = copy.deepcopy(ref).to("jax")
    opt, ref_opt = optimizer(model.parameters()), optimizer(ref.parameters())

    def step(model, opt, x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    jitted = t2j.jit(step)
    x = torch.randn(5, 4)
    for _ in range(6):
        torch.testing.assert_close(jitted(model, opt, x.to("jax")).cpu(), step(ref, ref_opt, x))
    torch.testing.assert_close(model.weight.detach().cpu(), ref.weight.detach())
    assert opt.state[model.weight]["step"] == ref_opt.state[ref.weight]["step"] == 6
    assert jitted.stats["traces"] <= 3 and jitted.stats["hits"] >= 3


def test_check_tensor_all_on_traced_values_is_checked_when_the_program_runs():
    # cond._is_all_true().item() stopped the trace: every HF vision-language step (its image-token check) ran eagerly
    def f(ids, feats):
        n = (ids == 3).sum()
        torch._check_tensor_all_with(ValueError, n * 2 == feats.numel(), lambda: "image tokens and features differ")
        torch._check_tensor_all(feats.isfinite())
        return feats * 2

    run = t2j.jit(f)
    feats = torch.ones(2, 2, device="jax")
    assert run(torch.tensor([1, 3, 3, 4], device="jax"), feats).tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert run.stats["eager_calls"] == 0 and run.stats["compiles"] == 1
    with pytest.raises(ValueError, match="image tokens and features differ"):
        run(torch.tensor([1, 3, 3, 3], device="jax"), feats)
    with pytest.raises(RuntimeError, match="Expected cond to be True"):
        run(torch.tensor([1, 3, 3, 4], device="jax"), feats / 0)


def test_a_view_of_state_at_a_position_the_program_takes_is_a_view():
    # with pos a program input (it changes every call), the view came back as a copy: later writes to the
    # cache were not seen through it, nor writes through it by the cache
    def run(device, wrap, store):
        cache = torch.zeros(4, 6, device=device)
        holder = types.SimpleNamespace(window=None)

        def f(pos):
            cache[:, pos] += pos + 1
            if store:
                holder.window = cache[pos:pos + 2]
            return cache[:, pos]

        fn = wrap(f)
        columns = [fn(pos) for pos in range(3)]
        window = holder.window
        cache.mul_(10)
        columns[1].add_(1)  # through the view, into the cache
        seen = [c.tolist() for c in columns] + [cache.tolist()] + ([window.tolist()] if store else [])
        return seen, fn

    for store in (False, True):
        expected, _ = run("cpu", lambda f: f, store)
        got, jitted = run("jax", t2j.jit, store)
        assert got == expected
        assert jitted.stats["eager_calls"] == 0
    # (a view stored in state is state whose offset is part of the cache key: each position traces)
    _, jitted = run("jax", t2j.jit, False)
    assert jitted.stats["hits"] == 1


def test_a_held_partial_of_a_builtin_function_is_followed():
    # HF's activations hold ``partial(F.gelu, approximate="tanh")``: F.gelu is a C builtin
    act = functools.partial(F.gelu, approximate="tanh")
    f = t2j.jit(lambda x: act(x) * 2)
    x = torch.randn(5)
    torch.testing.assert_close(f(x.to("jax")).cpu(), F.gelu(x, approximate="tanh") * 2)


_SWEEP = {}  # the model and optimizer of the trial a sweep runs now (module globals, as a notebook's)


def _sweep_step(x):
    model, opt = _SWEEP["model"], _SWEEP["opt"]
    opt.zero_grad()
    loss = model(x).pow(2).sum()
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("rebuilt", ["model_and_optimizer", "parameter"])
def test_a_step_traced_for_other_objects_of_the_same_structure_is_not_reused(rebuilt):
    # a hyperparameter sweep makes a new model and optimizer per trial; the program of the first trial
    # stored .grad and Adam's state into the first trial's objects
    x = torch.randn(5, 4)
    step = t2j.jit(_sweep_step)
    last = {}  # device -> the last trial's model
    for trial, lr in enumerate((0.01, 0.02)):
        runs = {}
        for device in ("cpu", "jax"):
            if rebuilt == "model_and_optimizer" or trial == 0:
                torch.manual_seed(0)
                model = nn.Linear(4, 3).to(device)
            else:  # the weight replaced by a new Parameter and the optimizer pointed at it
                model = last[device]
                model.weight = nn.Parameter(model.weight.detach() * 0.5)
            opt = torch.optim.Adam(model.parameters(), lr=lr)
            _SWEEP.update(model=model, opt=opt)
            losses = [(step if device == "jax" else _sweep_step)(x.to(device)).item() for _ in range(4)]
            runs[device] = (model, opt, losses)
        (cm, co, cl), (jm, jo, jl) = runs["cpu"], runs["jax"]
        assert jl == pytest.approx(cl, rel=1e-5)
        assert len(jo.state) == len(co.state) == 2
        torch.testing.assert_close(jm.weight.grad.cpu(), cm.weight.grad)
        torch.testing.assert_close(jo.state[jm.weight]["exp_avg"].cpu(), co.state[cm.weight]["exp_avg"])
        last.update(cpu=cm, jax=jm)


def test_a_sweep_keeps_the_programs_of_its_last_trials_only():
    # each program holds the parameters and optimizer state it stores into: a long sweep kept them all
    step = t2j.jit(_sweep_step)
    trials, params = [], []
    for trial in range(7):
        torch.manual_seed(trial)
        model = nn.Linear(4, 3).to("jax")
        _SWEEP.update(model=model, opt=torch.optim.Adam(model.parameters(), lr=0.01))
        for _ in range(2):
            step(torch.randn(5, 4, device="jax"))
        trials.append((model, _SWEEP["opt"]))
        params.append(weakref.ref(model.weight))
    # an early trial's objects again (their programs dropped): traced again, and right
    torch.manual_seed(1)
    x = torch.randn(5, 4)
    model, opt = trials[1]
    ref = copy.deepcopy(model).cpu()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref_opt.load_state_dict(opt.state_dict())
    _SWEEP.update(model=ref, opt=ref_opt)
    want = _sweep_step(x)
    _SWEEP.update(model=model, opt=opt)
    traces = step.stats["traces"]
    torch.testing.assert_close(step(x.to("jax")).cpu(), want)
    torch.testing.assert_close(model.weight.cpu(), ref.weight)
    assert step.stats["traces"] == traces + 1
    del trials, model, opt, ref_opt
    _SWEEP.clear()
    gc.collect()
    # (the first trials' are gone, the last ones' kept)
    assert params[0]() is None and params[2]() is None and params[6]() is not None


_ACT = torch.relu
_TEMPERATURE = 1.0


class _Settings:
    scale = 1.0


def _helper(x):
    return x / _TEMPERATURE


class _Scaled(nn.Module):
    shift = 0.0  # a class attribute its forward reads

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.fn = None

    def forward(self, x):
        out = _helper(self.lin(x)) + self.shift
        return out if self.fn is None else self.fn(out)


def test_functions_and_class_attributes_it_reads_are_guarded(monkeypatch):
    torch.manual_seed(0)
    ref = _Scaled()
    model = copy.deepcopy(ref).to("jax")
    k = [1.0]

    def run(m, x):
        return _ACT(m(x)) * _Settings.scale

    f = t2j.jit(lambda x: run(model, x))
    x = torch.randn(5, 4)
    changes = [lambda: None,
               lambda: monkeypatch.setattr(sys.modules[__name__], "_ACT", torch.tanh),  # a global function
               lambda: monkeypatch.setattr(_Settings, "scale", 3.0),  # a settings class's attribute
               lambda: monkeypatch.setattr(sys.modules[__name__], "_TEMPERATURE", 4.0),  # read by a forward's helper
               lambda: monkeypatch.setattr(_Scaled, "shift", 0.5),  # a module class's attribute
               lambda: [setattr(m, "fn", lambda o: o * k[0]) for m in (ref, model)],
               lambda: k.__setitem__(0, 7.0),  # what a function held by the module closes over
               lambda: [setattr(m, "fn", torch.sigmoid) for m in (ref, model)]]  # a builtin function attribute
    for i, change in enumerate(changes):
        change()
        torch.testing.assert_close(f(x.to("jax")).cpu(), run(ref, x).detach(), msg=f"change {i}")


def test_inference_mode_and_no_grad_are_different_programs():
    lin = nn.Linear(3, 2).to("jax")
    f = t2j.jit(lambda x: lin(x))
    x = torch.randn(4, 3, device="jax")
    with torch.inference_mode():
        assert f(x).is_inference()
    with torch.no_grad():
        out = f(x)
    assert not out.is_inference()
    out.add_(1)  # (an inference tensor refuses an in-place update outside inference mode)


class _Namespace:
    scale = 2.0


def _jitted_body(x):
    return x * _Namespace.scale + _Namespace.offset(x)


def _offset(x):
    return x.sum()


_Namespace.offset = staticmethod(_offset)
offset = t2j.jit(_jitted_body)  # (a global named as an attribute its code reads: `_Namespace.offset`)


def test_a_jitted_function_its_own_code_reaches_is_followed_into_its_function_not_its_cache():
    # the root walk reached the JitFunction (the global ``offset``) and, through its cache, the last call's CPU
    # argument: a new one every call, so every call traced again
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(offset(x).cpu(), x * 2 + x.sum())
    assert offset.stats["traces"] == 1


def test_save_on_cpu_inside_a_jitted_step_keeps_one_program():
    def run(device, jit):
        torch.manual_seed(0)
        m = nn.Linear(3, 1).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            with torch.autograd.graph.save_on_cpu():
                loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        s = t2j.jit(step, fullgraph=True) if jit else step
        x = torch.randn(5, 3).to(device)
        return [s(x).item() for _ in range(3)]

    assert run("jax", True) == pytest.approx(run("cpu", False), rel=1e-5)


@pytest.mark.parametrize("case", ["binomial_support", "binomial_entropy", "multinomial_entropy"])
def test_a_number_computed_from_constants_in_the_trace_is_a_constant(case):
    # (Binomial(4, ...) broadcasts its count to a tensor made in the trace and reads int(total_count.max()))
    fn = {"binomial_support": lambda p: torch.distributions.Binomial(4, probs=p).enumerate_support(),
          "binomial_entropy": lambda p: torch.distributions.Binomial(10, logits=p).entropy(),
          "multinomial_entropy": lambda p: torch.distributions.Multinomial(7, probs=p).entropy()}[case]
    p = torch.tensor([0.2, 0.3, 0.5])
    got = t2j.jit(fn, fullgraph=True)(p.to("jax"))
    torch.testing.assert_close(got.cpu(), fn(p))


def test_a_setting_read_from_a_users_own_module_is_guarded(tmp_path, monkeypatch):
    # ``import cfg; x * cfg.SCALE``: a value set on the user's settings module between calls is seen
    # (was: frozen into the program at its first value), by a jitted function and by a module's forward
    (tmp_path / "t2j_settings_for_test.py").write_text("SCALE = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import t2j_settings_for_test as cfg

    class Scaled(torch.nn.Module):
        def forward(self, x):
            return x * cfg.SCALE

    f, h = t2j.jit(lambda x: x * cfg.SCALE + 1), t2j.jit(Scaled())
    x = torch.ones(2, device="jax")
    for scale in (1.0, 3.0, 3.0):
        cfg.SCALE = scale
        assert f(x).tolist() == [scale + 1] * 2 and h(x).tolist() == [scale] * 2
    assert f.stats["traces"] == 2


def test_threads_trace_and_run_eager_ops_at_once():
    # a trace sets state every thread's ops read (the tensors it captures, its traced RNG key): two threads
    # tracing their own steps, and a third running eager random ops meanwhile, each get their own results
    torch.manual_seed(0)
    base = nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def train(model, lr, wrap, device):
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        def step(x, y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        step = wrap(step)
        return [step(x.to(device), y.to(device)).item() for _ in range(2)]

    results, errors, done = {}, [], threading.Event()

    def jitted(lr):
        try:
            results[lr] = train(copy.deepcopy(base).to("jax"), lr, t2j.jit, "jax")
        except Exception as e:  # (raised in the test's thread below)
            errors.append(e)

    def eager():
        try:
            a = torch.randn(8, 8, device="jax")
            while not done.is_set():
                b = torch.randn(8, 8, device="jax")
                torch.testing.assert_close((a @ b).relu().cpu(), (a.cpu() @ b.cpu()).relu())
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=jitted, args=(lr,)) for lr in (0.01, 0.02)]
    side = threading.Thread(target=eager)
    for t in [side, *threads]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    side.join()
    assert not errors, errors
    for lr in (0.01, 0.02):
        assert results[lr] == pytest.approx(train(copy.deepcopy(base), lr, lambda f: f, "cpu"), rel=1e-5)
