"""Train the example GPT with FSDP x tensor parallelism on 8 (virtual) devices.

    python examples/fsdp_tp.py [--steps 30]

On a CPU-only machine the 8 devices are virtual (XLA's host-platform device count);
on a multi-GPU host drop that line and the same code shards over the GPUs. The
parameters are split over a 2 x 4 mesh ("data" x "model"): attention and MLP
weights tensor-parallel on "model" and FSDP on "data"; each batch is split over
"data". t2j.jit compiles one SPMD program for the whole step, and the loss
matches a single-device run.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import copy  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import gpt  # noqa: E402

import torch2jax as t2j  # noqa: E402

P = t2j.parallel


def train(model, steps, data, mesh=None):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    @t2j.jit
    def step(x, y):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, y = data.batch(16, gen)
        if mesh is not None:
            x, y = P.shard_batch(x, mesh, "data"), P.shard_batch(y, mesh, "data")
        losses.append(step(x, y).item())
    return losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    data = gpt.CharData(gpt.make_text(2000), 64)
    base = gpt.GPT(gpt.GPTConfig(vocab_size=data.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=128))

    mesh = P.make_mesh({"data": 2, "model": 4})
    model = P.shard_model(copy.deepcopy(base).to("jax"), mesh, P.tensor_parallel("model", fsdp_axis="data"))
    w = model.blocks[0].qkv.weight
    print(f"mesh {dict(mesh.shape)}; blocks[0].qkv.weight {tuple(w.shape)} sharded {P.sharding_of(w).spec}, "
          f"each device holds {tuple(w.jax().addressable_shards[0].data.shape)}")
    sharded = train(model, args.steps, data, mesh)
    single = train(copy.deepcopy(base).to("jax"), args.steps, data)
    print(f"loss, FSDP x TP on 8 devices: {sharded[0]:.4f} -> {sharded[-1]:.4f}")
    print(f"loss, one device:             {single[0]:.4f} -> {single[-1]:.4f}")
    print("max difference over all steps:", max(abs(a - b) for a, b in zip(sharded, single)))


if __name__ == "__main__":
    main()
