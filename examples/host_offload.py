"""Host offload: keep tensors and saved activations in host memory while a GPT trains.

    python examples/host_offload.py [--layers 2] [--embd 64] [--steps 3] [--tpu v5e:2x2]

Two things move to host memory here:

- a tensor, explicitly: an EMA copy of the weights lives in host memory
  (`t2j.offload.to_host`) and comes back to the device (`to_device`) to be updated;
- the activations a training step saves for its backward pass: with
  `t2j.use_scan_layers(model, remat=t2j.offload.offload_policy())` the outputs of the
  linear layers are written to host memory in the forward pass and read back in the
  backward pass, instead of staying in device memory (or being recomputed).

The offloaded model trains exactly like the one that keeps those activations on the
device. On a GPU or TPU that frees their device memory; on the CPU backend host and
device are the same RAM, so the saving shows only in a program compiled for an
accelerator: ``--tpu v5e:2x2`` compiles both steps ahead of time for that TPU topology
(`step.lower_for`, needs libtpu but no TPU; see benchmarks/offload_memory.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import jax
import torch

sys.path.insert(0, os.path.dirname(__file__))

import gpt  # noqa: E402

import torch2jax as t2j  # noqa: E402
from torch2jax import offload  # noqa: E402


def train(model, steps, batches, ema_decay=0.9):
    """``steps`` AdamW steps under t2j.jit; the EMA of the weights is kept in host memory."""
    step, _ = gpt.adamw_step(model, t2j.jit)
    ema = [offload.to_host(p.detach().clone()) for p in model.parameters()]
    losses = []
    for x in batches[:steps]:
        losses.append(step(x, x).item())
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                avg = offload.to_device(ema[i]).lerp_(p, 1 - ema_decay)
                ema[i] = offload.to_host(avg)
    return step, losses, ema


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tpu", metavar="TOPOLOGY", help="also compile the steps for this TPU topology (needs libtpu)")
    a = ap.parse_args()
    print(f"memory kinds of {jax.devices()[0]}: {offload.memory_kinds()}")

    cfg = gpt.GPTConfig(vocab_size=96, block_size=a.seq, n_layer=a.layers, n_head=4, n_embd=a.embd)
    torch.manual_seed(0)
    base = gpt.GPT(cfg).to("jax")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=gen).to("jax") for _ in range(a.steps)]

    policies = {"saved on the device": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                "offloaded to host": offload.offload_policy()}
    steps, losses = {}, {}
    for name, policy in policies.items():
        model = copy.deepcopy(base)
        t2j.use_scan_layers(model, remat=policy)
        steps[name], losses[name], ema = train(model, a.steps, batches)
        print(f"activations {name}: losses {[round(v, 6) for v in losses[name]]}")
    print(f"EMA weights live in memory kind {offload.memory_kind(ema[0])!r}")
    diff = max(abs(x - y) for x, y in zip(*losses.values()))
    print(f"max loss difference between the two: {diff:.2e}")

    model = copy.deepcopy(base)
    t2j.use_scan_layers(model, remat=policies["offloaded to host"])
    params = list(model.parameters())

    def grads(ids):
        ids = ids.long()  # (JAX without x64 traces the int64 batch as int32)
        with t2j.rng_key(jax.random.key(0)):
            return torch.autograd.grad(model(ids, ids)[1], params)

    moved = offload.offloaded_bytes(t2j.jax_view(grads), batches[0].cpu().numpy())
    print(f"activations moved to host per step: {moved / 2**20:.2f} MiB")

    if a.tpu:
        from jax.experimental import topologies

        tpu = topologies.get_topology_desc(a.tpu, platform="tpu").devices[0]
        for name, step in steps.items():
            memory = step.lower_for(tpu, batches[0], batches[0]).compile().memory_analysis()
            print(f"{tpu.device_kind}, activations {name}: device temp {memory.temp_size_in_bytes / 2**20:.1f} MiB, "
                  f"host temp {memory.host_temp_size_in_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
