"""Compile time of deep models: unrolled layers vs `t2j.use_scan_layers`, with and without remat.

    python benchmarks/compile_time.py [--layers 24 48] [--embd 128] [--seq 64] [--batch 8] [--steps 5]
                                      [--variants unrolled scan_layers ...]

For each depth, one GPT (examples/gpt.py) training step (forward, backward, AdamW)
compiled by `t2j.jit` several ways: layers unrolled (the plain Python loop), the same
with `t2j.use_scan_layers`, and both with remat (scan with `remat=True`; the
unrolled one wraps each block in `t2j.checkpoint`), and the hand-written JAX GPT
(benchmarks/jax_gpt.py: same weights, optax AdamW) unrolled and scanned. "stacked" is
``use_scan_layers(model, stack_parameters=True)``, the layout a JAX model uses: the
blocks' parameters live in one stacked ``nn.Parameter`` per name (12 instead of
12 x layers), so AdamW updates 12 stacked tensors. Columns: trace time (torch code
-> jaxpr), compile time (XLA), median step time and the program's memory (XLA
memory analysis), all from this one run.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))

import gpt  # noqa: E402
import jax  # noqa: E402
import jax_gpt  # noqa: E402

import torch2jax as t2j  # noqa: E402


VARIANTS = ("unrolled", "scan_layers", "unrolled + remat", "scan_layers + remat", "scan_layers stacked",
            "scan_layers stacked + remat", "pure JAX unrolled", "pure JAX scan")


def _checkpointed_blocks(model):
    for block in model.blocks:
        block.forward = t2j.checkpoint(block.forward)


def measure_jax(base, variant, batches):
    """The hand-written JAX GPT (benchmarks/jax_gpt.py) with the same weights: what JAX
    itself gains from scanning the layers, the reference for the torch variants."""
    scan = variant.endswith("scan")
    step, opt = jax_gpt.train_step(base.cfg.n_head, scan)
    params = jax_gpt.params_from_torch(base, stacked=scan)
    state = opt.init(params)
    jb = [(jax.numpy.asarray(x.numpy()), jax.numpy.asarray(y.numpy())) for x, y in batches]
    jitted = jax.jit(step, donate_argnums=(0, 1))
    t = time.perf_counter()
    traced = jitted.trace(params, state, *jb[0])
    trace = time.perf_counter() - t
    t = time.perf_counter()
    compiled = traced.lower().compile()
    compile_s = time.perf_counter() - t
    params, state, loss = compiled(params, state, *jb[0])
    params, state, loss = compiled(params, state, *jb[1])
    times = []
    for x, y in jb[2:]:
        t = time.perf_counter()
        params, state, loss = compiled(params, state, x, y)
        loss.block_until_ready()
        times.append(time.perf_counter() - t)
    m = compiled.memory_analysis()
    mem = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes) / 2**20
    return {"trace": trace, "compile": compile_s, "ms": statistics.median(times) * 1e3, "mem": mem, "loss": float(loss),
            "first": trace + compile_s}


def measure(base, variant, batches):
    if variant.startswith("pure JAX"):
        return measure_jax(base, variant, batches)
    model = copy.deepcopy(base).to("jax")
    if variant.startswith("scan"):
        t2j.use_scan_layers(model, remat=True if "remat" in variant else None,
                            stack_parameters="stacked" in variant)
    elif "remat" in variant:
        _checkpointed_blocks(model)
    step, opt = gpt.adamw_step(model, t2j.jit)

    jb = [(x.to("jax"), y.to("jax")) for x, y in batches]
    t = time.perf_counter()
    step(*jb[0])  # creates grads and optimizer state (a program of its own); the steady-state one is traced next
    first = time.perf_counter() - t
    t = time.perf_counter()
    lowered = step.lower(*jb[1])
    trace = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t
    step(*jb[1])
    times = []
    for x, y in jb[2:]:
        t = time.perf_counter()
        loss = step(x, y).jax().block_until_ready()
        times.append(time.perf_counter() - t)
    m = compiled.memory_analysis()
    mem = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes) / 2**20
    return {"trace": trace, "compile": compile_s, "ms": statistics.median(times) * 1e3, "mem": mem, "loss": float(loss),
            "first": first}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 48])
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args()
    print("| layers | variant | trace s | compile s | trace+compile vs unrolled | ms/step | vs unrolled | memory MiB | "
          "first call s | last loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.layers:
        cfg = gpt.GPTConfig(vocab_size=96, block_size=args.seq, n_layer=n, n_head=args.heads, n_embd=args.embd)
        torch.manual_seed(0)
        base = gpt.GPT(cfg)
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randint(0, 96, (args.batch, args.seq), generator=g),
                    torch.randint(0, 96, (args.batch, args.seq), generator=g)) for _ in range(args.steps + 2)]
        rows = {}
        for v in ["unrolled"] + [v for v in args.variants if v != "unrolled"]:
            rows[v] = r = measure(base, v, batches)
            ref = rows["unrolled"]
            speedup = (ref["trace"] + ref["compile"]) / (r["trace"] + r["compile"])
            print(f"| {n} | {v} | {r['trace']:.2f} | {r['compile']:.2f} | {speedup:.1f}x faster | {r['ms']:.1f} | "
                  f"{r['ms'] / ref['ms']:.2f}x | {r['mem']:.1f} | {r['first']:.1f} | {r['loss']:.6f} |", flush=True)


if __name__ == "__main__":
    main()
