"""Host time of one cached `t2j.jit` call of a GPT training step (zero_grad, forward,
backward, AdamW), split into finding the cached program (the walk over the state the
step carries), JAX's call of the compiled program, and the rest of running it (argument
assembly, writing the state back).

    python benchmarks/jit_overhead.py [--layers 4] [--embd 32] [--seq 16] [--batch 2] [--rounds 25] [--calls 200]

By default the model is tiny so that the program itself costs little: the numbers are the
Python and dispatch overhead a larger model pays on every step too. On a GPU,
`--embd 256 --seq 128 --batch 16 --heads 8` is benchmarks/train_step.py's model. Main-thread
CPU time (`time.thread_time`), the minimum over rounds (this machine is shared and noisy);
the calls are not synced, as in a loop that does not print its loss.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import gpt  # noqa: E402

import torch2jax as t2j  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab_size=65, block_size=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.embd)
    with t2j.env():
        model = gpt.GPT(cfg).to("jax")
        step, _ = gpt.adamw_step(model, t2j.jit, lr=1e-3)
        x, y = (torch.randint(0, 65, (a.batch, a.seq)).to("jax") for _ in range(2))
        for _ in range(3):
            step(x, y)
        entry = step._lookup((x, y), {})[0]
        program = entry.jitted
        called = []

        def timed_program(*arrays):
            t = time.thread_time()
            result = program(*arrays)
            called.append(time.thread_time() - t)
            return result

        entry.jitted = timed_program
        lookup, run, jax_call = [], [], []
        for _ in range(a.rounds):
            tl = tr = 0.0
            called.clear()
            for _ in range(a.calls):
                t0 = time.thread_time()
                entry, leaves, slots, storages = step._lookup((x, y), {})
                t1 = time.thread_time()
                out = step._run(entry, leaves, slots, storages, ((x, y), {}))
                tr += time.thread_time() - t1
                tl += t1 - t0
            out.jax().block_until_ready()
            lookup.append(tl / a.calls * 1e6)
            run.append(tr / a.calls * 1e6)
            jax_call.append(sum(called) / len(called) * 1e6)
        entry.jitted = program
        jit_module = importlib.import_module("torch2jax.jit")  # (t2j.jit is the function)
        donated, kept, _, _ = entry.arguments([st.array for st in storages], jit_module._hyper_values(slots), None)
        n_args = len(donated) + len(kept)
    print(f"GPT {a.layers} layers, d={a.embd}: {len(list(model.parameters()))} parameters, {len(slots.tensors)} state "
          f"slots, {n_args} state arrays passed to the program")
    print(f"find the cached program: {min(lookup):.0f} us; run it and write the state back: {min(run):.0f} us "
          f"(of which JAX's call of the compiled program: {min(jax_call):.0f} us); total {min(lookup) + min(run):.0f} "
          f"us per call (main-thread CPU time, min of {a.rounds} rounds)")


if __name__ == "__main__":
    main()
