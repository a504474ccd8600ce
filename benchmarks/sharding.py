"""FSDP scaling on 1, 2, 4 and 8 devices: per-device state memory, step time, collectives.

    python benchmarks/sharding.py [--layers 4] [--embd 256] [--batch 16] [--steps 5]

On a CPU machine the devices are virtual (one process, XLA's host-platform device
count), so step times show the partitioned program's overhead, not a speedup. For
each device count: parameter + AdamW state bytes held by one device, median step
time, and the collectives in the compiled program (counted in its HLO).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import copy  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import gpt  # noqa: E402

import torch2jax as t2j  # noqa: E402

P = t2j.parallel
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def run(base, n, args):
    mesh = P.make_mesh({"data": n}, devices=jax.devices()[:n])
    model = P.shard_model(copy.deepcopy(base).to("jax"), mesh, P.fsdp("data"))
    step, opt = gpt.adamw_step(model, t2j.jit)

    g = torch.Generator().manual_seed(0)
    batches = [(P.shard_batch(torch.randint(0, 96, (args.batch, args.seq), generator=g), mesh),
                P.shard_batch(torch.randint(0, 96, (args.batch, args.seq), generator=g), mesh))
               for _ in range(args.steps + 2)]
    step(*batches[0])
    step(*batches[1])
    hlo = step.lower(*batches[2]).compile().as_text()
    counts = {c: len(re.findall(rf"= \S+ {c}(-start)?\(", hlo)) for c in COLLECTIVES}
    times = []
    for x, y in batches[2:]:
        t = time.perf_counter()
        step(x, y).jax().block_until_ready()
        times.append(time.perf_counter() - t)
    state = [p for p in model.parameters()] + [v for s in opt.state.values() for v in s.values()
                                               if isinstance(v, torch.Tensor)]
    per_device = sum(t.jax().addressable_shards[0].data.nbytes for t in state) / 2**20
    return per_device, statistics.median(times) * 1e3, counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = gpt.GPT(gpt.GPTConfig(vocab_size=96, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.embd))
    print(f"GPT {args.layers} layers, d={args.embd}, {gpt.n_params(base) / 1e6:.2f}M params; FSDP over 'data'; "
          f"{jax.devices()[0].platform} devices")
    print("| devices | params + AdamW state per device (MiB) | vs 1 device | ms/step | collectives in the step |")
    print("|---|---|---|---|---|")
    base_mem = None
    for n in (1, 2, 4, 8):
        mem, ms, counts = run(base, n, args)
        base_mem = base_mem or mem
        text = ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"
        print(f"| {n} | {mem:.2f} | {mem / base_mem:.2f}x | {ms:.1f} | {text} |", flush=True)


if __name__ == "__main__":
    main()
