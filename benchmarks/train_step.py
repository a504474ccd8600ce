"""One GPT training step (forward + backward + AdamW), every way we can run it, in one run.

    python benchmarks/train_step.py [--layers 4] [--embd 256] [--heads 8] [--seq 128] [--batch 16]
                                    [--steps 20] [--no-torch-compile] [--matmul-precision highest|high]

Rows: torch eager CPU, torch.compile CPU, torch2jax `t2j.jit` with torch.optim.AdamW,
torch2jax with optax (`t2j.train.make_train_step`), torchax (where it imports; its own
process, see torchax_rows.py), and
the same model hand-written in flax.nnx + optax — the reference every ratio is
taken against. Columns: median step time, trace time, compile time and the
compiled program's memory (XLA's memory analysis: arguments + temporaries +
outputs not aliased to donated inputs). All numbers come from this one run.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "examples"), os.path.dirname(__file__)]

import gpt  # noqa: E402
import common  # noqa: E402
import jax_gpt  # noqa: E402
import torchax_rows  # noqa: E402

import torch2jax as t2j  # noqa: E402

LR, WD = 3e-4, 0.1


def _timed(step, batches, sync):
    """(median ms per step, synced after each as a loop printing its loss is; median main-thread CPU ms
    of the call alone: the host's work to launch the step, which the device waits for when synced)."""
    times, host = [], []
    for x, y in batches:
        t, c = time.perf_counter(), time.thread_time()
        out = step(x, y)
        host.append(time.thread_time() - c)
        sync(out)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, statistics.median(host) * 1e3


_NOT_RUN = ("parameter", "constant", "bitcast", "tuple", "get-tuple-element")


def _ops(compiled) -> int:
    """Instructions the compiled program runs at its top level (fusions, copies, library calls: about
    one kernel each on a GPU, where a step synced every call is often bound by launching them)."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    ops = (re.search(r"= \S+ ([a-z][\w-]*)\(", line) for line in entry.splitlines()[1:])
    return sum(1 for m in ops if m and m.group(1) not in _NOT_RUN)


def _mem(compiled):
    m = compiled.memory_analysis()
    if m is None:
        return None
    return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes) / 2**20


def torch_eager(model, batches, compile_=False):
    step, _ = gpt.adamw_step(copy.deepcopy(model), torch.compile if compile_ else (lambda f: f), lr=LR,
                             weight_decay=WD)
    row = {}
    if compile_:
        t = time.perf_counter()
        step(*batches[0])
        step(*batches[1])
        row["compile_s"] = time.perf_counter() - t
    else:
        step(*batches[0])
    row["ms"], row["host_ms"] = _timed(step, batches[2:], lambda loss: loss.item())
    return row


def t2j_jit(model, batches):
    model = copy.deepcopy(model).to("jax")
    step, _ = gpt.adamw_step(model, t2j.jit, lr=LR, weight_decay=WD)
    jb = [(x.to("jax"), y.to("jax")) for x, y in batches]
    t = time.perf_counter()
    step(*jb[0])
    step(*jb[1])  # the first call creates .grad and the optimizer state: the second is the steady state
    first = time.perf_counter() - t
    entries = [e for guarded in step._cache.values() for e in guarded]
    trace = entries[-1].trace_s
    compile_s = first - sum(e.trace_s for e in entries)
    lowered = step.lower(*jb[2])
    compiled = lowered.compile()
    ms, host = _timed(step, jb[2:], lambda loss: loss.jax().block_until_ready())
    return {"ms": ms, "host_ms": host, "trace_s": trace, "compile_s": compile_s / 2, "first_two_steps_s": first,
            "mem": _mem(compiled), "ops": _ops(compiled)}


def t2j_optax(model, batches):
    model = copy.deepcopy(model).to("jax")
    step = t2j.train.make_train_step(model, lambda m, x, y: m(x, y)[1], optax.adamw(LR, weight_decay=WD))
    jb = [(x.to("jax"), y.to("jax")) for x, y in batches]
    t = time.perf_counter()
    step(*jb[0])
    first = time.perf_counter() - t
    ms, host = _timed(step, jb[1:], lambda loss: loss.jax().block_until_ready())
    return {"ms": ms, "host_ms": host, "first_two_steps_s": first}


def torchax_row(args):
    """torchax's own way to train the same model (optax AdamW), in a process of its own: it cannot share
    one with torch2jax (torchax_rows.py)."""
    return torchax_rows.run("train", layers=args.layers, embd=args.embd, heads=args.heads, seq=args.seq,
                            batch=args.batch, steps=args.steps, lr=LR, weight_decay=WD,
                            matmul_precision=args.matmul_precision)


def pure_jax(model, batches, cfg):
    from flax import nnx

    jm = jax_gpt.GPT(cfg, nnx.Rngs(0))
    jax_gpt.load_from_torch(jm, model)
    graphdef, params = nnx.split(jm, nnx.Param)
    tx = optax.adamw(LR, weight_decay=WD)
    opt_state = tx.init(params)

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, donate_argnums=(0, 1))
    jb = [(jnp.asarray(x.numpy()), jnp.asarray(y.numpy())) for x, y in batches]
    t = time.perf_counter()
    traced = jitted.trace(params, opt_state, *jb[0])
    trace = time.perf_counter() - t
    t = time.perf_counter()
    compiled = traced.lower().compile()
    compile_s = time.perf_counter() - t
    state = {"p": params, "o": opt_state}

    def run(x, y):
        state["p"], state["o"], loss = jitted(state["p"], state["o"], x, y)
        return loss

    run(*jb[0])
    ms, host = _timed(run, jb[1:], lambda loss: loss.block_until_ready())
    return {"ms": ms, "host_ms": host, "trace_s": trace, "compile_s": compile_s, "mem": _mem(compiled),
            "ops": _ops(compiled)}


def main():
    ap = argparse.ArgumentParser()
    common.add_gpt_arguments(ap)
    ap.add_argument("--no-torch-compile", action="store_true")
    args = ap.parse_args()
    common.set_matmul_precision(args.matmul_precision)
    cfg, model, batches = common.gpt_problem(args)

    rows = {"pure JAX (flax.nnx + optax)": pure_jax(model, batches, cfg)}
    rows["torch2jax t2j.jit + torch.optim.AdamW"] = t2j_jit(model, batches)
    rows["torch2jax make_train_step + optax"] = t2j_optax(model, batches)
    rows["torch eager CPU"] = torch_eager(model, batches)
    if not args.no_torch_compile:
        rows["torch.compile CPU"] = torch_eager(model, batches, compile_=True)
    rows["torchax (make_train_step + optax)"] = torchax_row(args)

    ref = rows["pure JAX (flax.nnx + optax)"]
    tokens = args.batch * args.seq
    print(f"GPT {args.layers} layers, d={args.embd}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
          f"{gpt.n_params(model) / 1e6:.2f}M params; {args.steps} timed steps (median)")
    print(f"jax {jax.__version__} ({jax.devices()[0].device_kind}), torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"float32 matmul precision {args.matmul_precision!r}")
    print()
    print("| implementation | ms/step | vs JAX | host ms/call | tokens/s | trace s | vs JAX | compile s | memory MiB "
          "| vs JAX | program ops |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def fmt(v, spec):
        return "" if v is None else format(v, spec)

    for name, r in rows.items():
        if "note" in r:
            print(f"| {name} | {r['note']} | | | | | | | | | |")
            continue
        ms, tr, mem = r.get("ms"), r.get("trace_s"), r.get("mem")
        print(f"| {name} | {ms:.1f} | {ms / ref['ms']:.2f}x | {fmt(r.get('host_ms'), '.2f')} | "
              f"{tokens / ms * 1e3:,.0f} | {fmt(tr, '.2f')} | "
              f"{fmt(tr and tr / ref['trace_s'], '.2f')}{'x' if tr else ''} | {fmt(r.get('compile_s'), '.2f')} | "
              f"{fmt(mem, '.1f')} | {fmt(mem and mem / ref['mem'], '.2f')}{'x' if mem else ''} | "
              f"{fmt(r.get('ops'), 'd')} |")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
