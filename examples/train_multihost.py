"""Data-parallel + FSDP training of the example GPT as several processes (multi-host).

Run the same script once per process; here, two processes on one machine:

    python examples/train_multihost.py --process-id 0 --num-processes 2 &
    python examples/train_multihost.py --process-id 1 --num-processes 2

Each process joins the job through `t2j.parallel.initialize` (jax.distributed; gloo
collectives on CPU) and sees the devices of every process. The model is FSDP-sharded
over all of them, each process gives its part of every global batch (`shard_batch(...,
process_local=True)`), which is split over the "data" axis, and `t2j.jit`
runs one SPMD program across the processes. Every process prints the same losses,
which equal a single-process run's. With ``--checkpoint DIR`` the processes save a
sharded checkpoint (`t2j.save`, orbax), load it into a freshly built model and
optimizer (`t2j.load`) and keep training: the losses go on as if uninterrupted. On CPU each process gets ``--local-devices``
virtual devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--coordinator", default="127.0.0.1:12355")
    ap.add_argument("--local-devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--checkpoint", help="after --steps steps, save here, resume into a fresh model and train on")
    ap.add_argument("--resume-steps", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.local_devices}")

    import torch2jax as t2j

    t2j.parallel.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)

    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    import gpt

    P = t2j.parallel
    mesh = P.make_mesh({"data": -1})

    def build(seed):
        torch.manual_seed(seed)
        model = gpt.GPT(gpt.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)).to("jax")
        P.shard_model(model, mesh, P.fsdp("data", min_size=256))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        @t2j.jit
        def step(x, y):
            opt.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            return loss

        return model, opt, step

    model, opt, step = build(0)
    gen = torch.Generator().manual_seed(0)  # every process draws the same global batches
    losses = []

    def train(steps):
        for _ in range(steps):
            x, y = torch.randint(0, 96, (8, 32), generator=gen), torch.randint(0, 96, (8, 32), generator=gen)
            # each process passes only its own rows (as its own data loader would give them)
            part = len(x) // P.process_count()
            rows = slice(part * P.process_index(), part * (P.process_index() + 1))
            x, y = (P.shard_batch(t[rows], mesh, "data", process_local=True) for t in (x, y))
            losses.append(step(x, y).item())

    train(args.steps)
    if args.checkpoint:
        # every process writes the shards it holds; a fresh model and optimizer (other
        # initial weights, no optimizer state yet) resume from them and train on
        t2j.save({"model": model, "optimizer": opt, "step": args.steps}, args.checkpoint)
        model, opt, step = build(1)
        state = t2j.load(args.checkpoint, {"model": model, "optimizer": opt})
        assert state["step"] == args.steps
        train(args.resume_steps)
    # .cpu() of a parameter sharded over both processes' devices gathers it (every process calls it)
    sums = {name: p.detach().cpu().double().sum().item() for name, p in model.named_parameters()}
    print(json.dumps({"process": P.process_index(), "processes": P.process_count(), "devices": mesh.size,
                      "losses": losses, "weight_sums": sums}))


if __name__ == "__main__":
    main()
