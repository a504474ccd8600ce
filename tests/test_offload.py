"""t2j.offload: placement in JAX memory kinds and remat policies that offload
saved activations, against torch CPU and against the same step without offload."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2jax as t2j
from torch2jax import offload

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

KINDS = offload.memory_kinds()
needs_host = pytest.mark.skipif("pinned_host" not in KINDS, reason="the device has no pinned_host memory")


def test_memory_kinds_are_the_devices():
    assert KINDS == tuple(m.kind for m in jax.devices()[0].addressable_memories())
    assert "device" in KINDS


@needs_host
def test_to_host_and_back_keep_the_value():
    cpu = torch.randn(4, 5)
    t = cpu.to("jax")
    h = offload.to_host(t)
    assert isinstance(h, t2j.Tensor) and offload.memory_kind(h) == "pinned_host"
    assert h.jax().sharding.memory_kind == "pinned_host"
    d = offload.to_device(h)
    assert offload.memory_kind(d) == "device" == d.jax().sharding.memory_kind
    torch.testing.assert_close(h.cpu(), cpu)
    torch.testing.assert_close(d.cpu(), cpu)
    a = offload.to_host(t.jax())
    assert isinstance(a, jax.Array) and a.sharding.memory_kind == "pinned_host"


@needs_host
def test_to_host_is_differentiable_like_identity():
    cpu = torch.randn(3, 4, requires_grad=True)
    (cpu.sin() * 2).sum().backward()
    t = cpu.detach().to("jax").requires_grad_()
    out = offload.to_device(offload.to_host(t).sin() * 2).sum()
    out.backward()
    torch.testing.assert_close(t.grad.cpu(), cpu.grad)


@needs_host
def test_to_host_inside_t2j_jit():
    t = torch.randn(4, 4, device="jax")
    f = t2j.jit(lambda x: (offload.to_host(x), offload.to_device(offload.to_host(x)) + 1))
    h, d = f(t)
    assert offload.memory_kind(h) == "pinned_host" and offload.memory_kind(d) == "device"
    torch.testing.assert_close(d.cpu(), t.cpu() + 1)


def test_offload_refuses_bad_input():
    with pytest.raises(TypeError, match=r"offload.to_host: expected a tensor on the jax device .* got a tensor on cpu"):
        offload.to_host(torch.ones(2))
    with pytest.raises(ValueError, match=r"offload.to_host: memory kind 'hbm' is not one of the device's memory kinds"):
        offload.to_host(torch.ones(2, device="jax"), "hbm")
    with pytest.raises(ValueError, match=r"to_host: kind='device' is not host memory; use t2j.offload.to_device"):
        offload.to_host(torch.ones(2, device="jax"), "device")
    with pytest.raises(TypeError, match=r"offload.name: label must be a str, got int"):
        offload.name(torch.ones(2, device="jax"), 3)
    with pytest.raises(TypeError, match=r"offload_policy: names must be activation labels \(str\), got \[1\]"):
        offload.offload_policy([1])


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(offload.name(torch.tanh(self.fc1(x)), "hidden"))


def _blocks():
    torch.manual_seed(0)
    return nn.ModuleList(_Block() for _ in range(3))


def _grads_fn(blocks, mode, policy):
    """The gradients of the blocks' parameters, as a JAX function of the input."""
    params = list(blocks.parameters())

    def grads(h):
        with t2j.rng_key(jax.random.key(0)):
            if mode == "checkpoint":
                for b in blocks:
                    h = t2j.checkpoint(b, policy=policy)(h)
            else:
                h = t2j.scan_layers(blocks, h, remat=policy)
            return torch.autograd.grad(h.pow(2).sum(), params)

    return t2j.jax_view(grads)


@pytest.mark.parametrize("mode", ["checkpoint", "scan_layers"])
@pytest.mark.parametrize("by_name", [False, True], ids=["dots", "names"])
def test_offload_policy_offloads_saved_activations_and_keeps_grads(mode, by_name):
    cpu_blocks = _blocks()
    x = torch.randn(8, 16)
    h = x
    for b in cpu_blocks:
        h = b.fc2(torch.tanh(b.fc1(h))) + h
    h.pow(2).sum().backward()
    expected = [p.grad.numpy() for p in cpu_blocks.parameters()]
    blocks = _blocks().to("jax")
    policy = offload.offload_policy(["hidden"] if by_name else None)
    fn = _grads_fn(blocks, mode, policy)
    # the tanh input (8 x 32 float32) of each of the 3 blocks waits on the host
    assert offload.offloaded_bytes(fn, x.numpy()) == 3 * 8 * 32 * 4
    assert offload.offloaded_bytes(_grads_fn(blocks, mode, None if mode == "checkpoint" else True), x.numpy()) == 0
    for g, e in zip(jax.jit(fn)(x.numpy()), expected):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4)


def test_make_train_step_with_offload_policy_matches_plain_step():
    x, y = torch.randn(8, 16), torch.randn(8, 16)

    def run(remat):
        model = _blocks().to("jax")
        net = nn.Sequential(*model)
        step = t2j.train.make_train_step(net, lambda m, x, y: F.mse_loss(m(x), y), optax.sgd(0.1), remat=remat)
        losses = [step(x, y).item() for _ in range(3)]
        return losses, [p.detach().cpu().numpy() for p in net.parameters()]

    plain_losses, plain = run(None)
    losses, params = run(offload.offload_policy())
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    assert losses[-1] < losses[0]
    for a, b in zip(params, plain):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _gpt_step_memory(remat, cfg, batch):
    from gpt import GPT, adamw_step

    torch.manual_seed(0)
    model = GPT(cfg).to("jax")
    t2j.use_scan_layers(model, remat=remat)
    step, _ = adamw_step(model, t2j.jit)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=torch.Generator().manual_seed(0))
    memory = step.lower(x, x).compile().memory_analysis()
    params = list(model.parameters())

    def grads(ids):
        ids = ids.long()  # (JAX made the int64 ids int32: jax_enable_x64 is off)
        with t2j.rng_key(jax.random.key(0)):
            return torch.autograd.grad(model(ids, ids)[1], params)

    to_host = offload.offloaded_bytes(t2j.jax_view(grads), x.numpy())
    return memory.temp_size_in_bytes, memory.host_temp_size_in_bytes, to_host, step(x, x).item()


@pytest.mark.slow
def test_gpt_step_memory_with_offload_policy():
    """The measurement in benchmarks/RESULTS.md ("Host offload"):
    ``python -m pytest -q -s -p no:cacheprovider tests/test_offload.py -k gpt_step_memory``."""
    from gpt import GPTConfig

    cfg = GPTConfig(vocab_size=96, block_size=128, n_layer=4, n_head=4, n_embd=128)
    save_dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    variants = {"no remat": None, "remat (save nothing)": True,
                "remat, save dots (dots_with_no_batch_dims_saveable)": save_dots,
                "remat, offload dots (t2j.offload.offload_policy())": offload.offload_policy()}
    rows = {name: _gpt_step_memory(remat, cfg, batch=8) for name, remat in variants.items()}
    print(f"\nbackend={jax.default_backend()} GPT {cfg.n_layer} layers, d={cfg.n_embd}, T={cfg.block_size}, batch 8, "
          "AdamW under t2j.jit, layers scanned")
    print("| variant | device temp MiB | host temp MiB | activations moved to host MiB | loss |")
    for name, (temp, host_temp, to_host, loss) in rows.items():
        print(f"| {name} | {temp / 2**20:.1f} | {host_temp / 2**20:.1f} | {to_host / 2**20:.1f} | {loss:.6f} |")
    losses = [r[3] for r in rows.values()]
    np.testing.assert_allclose(losses, losses[0], rtol=1e-6)
    offloaded = rows["remat, offload dots (t2j.offload.offload_policy())"]
    assert offloaded[2] > 0 and rows["no remat"][2] == 0
    assert offloaded[0] < rows["no remat"][0]
