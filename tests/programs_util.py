"""The harness shared by tests/test_programs2.py, test_programs3.py and test_programs4.py:
seeded data and models, a training step, and a comparison of a program's result tree on
the jax device (eager or under t2j.jit) against torch CPU's (the oracle)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2jax as t2j


def _ident(fn):
    return fn


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, device="cpu"):
    return torch.randn(*shape, generator=_gen(seed)).to(device)


def _mlp(device, seed=0, sizes=(6, 16, 3)):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.Tanh(), nn.Linear(sizes[1], sizes[2])).to(device)


def _batches(n, device, seed=1, batch=8):
    g = _gen(seed)
    return [(torch.randn(batch, 6, generator=g).to(device), torch.randint(0, 3, (batch,), generator=g).to(device))
            for _ in range(n)]


def _compare(actual, expected, what, atol=1e-5, rtol=1e-5):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), (what, type(actual))
        assert actual.device.type == "jax", (what, actual.device)
        assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
        assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
        torch.testing.assert_close(actual.detach().cpu(), expected.detach(), msg=what, atol=atol, rtol=rtol,
                                   equal_nan=True)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), what
        for k in expected:
            _compare(actual[k], expected[k], f"{what}[{k!r}]", atol, rtol)
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected), what
        for k, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, f"{what}[{k}]", atol, rtol)
    elif isinstance(expected, float):
        assert actual == pytest.approx(expected, rel=rtol * 10, abs=atol * 10), what
    else:
        assert actual == expected, what


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_step(model, opt, loss_fn):
    """One optimizer step on ``loss_fn(model, *batch)``: zero_grad, backward, step."""

    def step(*batch):
        opt.zero_grad()
        loss = loss_fn(model, *batch)
        loss.backward()
        opt.step()
        return loss

    return step


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


def run_program(programs, tolerances, name, jit):
    """Program ``name`` on torch CPU and on the jax device (eagerly or under t2j.jit), compared."""
    program = programs[name]
    expected = program("cpu", _ident)
    actual = program("jax", t2j.jit if jit else _ident)
    _compare(actual, expected, name, **tolerances.get(name, {}))


def to_device(tree, device):
    """``tree`` (tensors in lists, tuples and dicts) with its tensors moved to ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(t, device) for t in tree)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    return tree
