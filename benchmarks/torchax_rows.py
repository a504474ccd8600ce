"""torchax's rows of our benchmarks, run in a process of their own.

torchax and torch2jax both register torch's PrivateUse1 backend as "jax" (and the
``torch.jax`` device module), so one process can hold only one of them. The benchmarks
that compare against torchax start this script with the same configuration and read
one JSON line back:

    python benchmarks/torchax_rows.py train --layers 4 --embd 256 --heads 8 --seq 128 --batch 16 --steps 20
    python benchmarks/torchax_rows.py eager

``train``: the GPT step of `train_step.py` (same weights, batches and AdamW settings)
the way torchax trains a torch model: ``torchax.train.make_train_step`` (forward and
backward through ``torch.func.functional_call`` under ``jax.value_and_grad``, optax's
AdamW) under ``interop.jax_jit`` with the weights and optimizer state donated.
``eager``: the single ops of `eager_overhead.py` on torchax tensors, timed in
interleaved rounds with the same jax.numpy calls, so the ratio comes from one process.
If torchax does not import, the JSON says why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import optax
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), HERE]

from common import add_gpt_arguments  # noqa: E402


def _import_torchax():
    try:
        import torchax
        import torchax.train  # noqa: F401
    except Exception as e:  # noqa: BLE001 - report why and skip
        return None, f"does not import: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    return torchax, None


def train(args) -> dict:
    torchax, why = _import_torchax()
    if torchax is None:
        return {"note": why}
    import statistics

    from torchax import interop

    from common import gpt_problem, set_matmul_precision

    _, model, batches = gpt_problem(args)
    env = torchax.default_env()
    set_matmul_precision(args.matmul_precision)  # after torchax's set-up, which switches JAX's
    tx = optax.adamw(args.lr, weight_decay=args.weight_decay)
    with env:
        model.to("jax")
        weights = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        opt_state = interop.call_jax(tx.init, weights)

        def model_fn(w, b, inputs):
            return torch.func.functional_call(model, {**w, **b}, inputs)

        step = torchax.train.make_train_step(model_fn, lambda out, label: out[1], tx)
        step = interop.jax_jit(step, kwargs_for_jax_jit={"donate_argnums": (0, 2)})
        jb = [(env.to_xla(x), env.to_xla(y)) for x, y in batches]
        t = time.perf_counter()
        loss, weights, opt_state = step(weights, buffers, opt_state, jb[0], jb[0][1])
        interop.jax_view(loss).block_until_ready()
        first = time.perf_counter() - t
        times, host = [], []
        for x, y in jb[1:]:
            t, c = time.perf_counter(), time.thread_time()
            loss, weights, opt_state = step(weights, buffers, opt_state, (x, y), y)
            host.append(time.thread_time() - c)
            interop.jax_view(loss).block_until_ready()
            times.append(time.perf_counter() - t)
    return {"ms": statistics.median(times) * 1e3, "host_ms": statistics.median(host) * 1e3, "first_step_s": first,
            "loss": float(interop.jax_view(loss))}


def eager(args) -> dict:
    torchax, why = _import_torchax()
    if torchax is None:
        return {"note": why}
    from common import bench, jax_cases

    env = torchax.default_env()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    rows = {}
    with env:
        a, b = env.to_xla(a), env.to_xla(b)
        mlp.to("jax")
        ours = {"add 8x8": lambda: a + b, "mul 8x8": lambda: a * b, "matmul 8x8": lambda: a @ b,
                "MLP forward (8-32-8)": lambda: mlp(a)}
        ref = jax_cases()
        for op, fn in ours.items():
            r = bench({"torchax": fn, "jax.numpy": ref[op]})
            rows[op] = {"us": r["torchax"][0], "vs_jnp": r["torchax"][0] / r["jax.numpy"][0],
                        "cpu_vs_jnp": r["torchax"][1] / r["jax.numpy"][1]}
    return {"rows": rows}


def run(mode: str, **options) -> dict:
    """This script's JSON for ``mode`` ("train" / "eager"), run in a fresh process."""
    import subprocess

    argv = [sys.executable, os.path.abspath(__file__), mode]
    for k, v in options.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    p = subprocess.run(argv, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"note": f"failed: {err[:120]}"}
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("train", "eager"))
    add_gpt_arguments(ap)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    args = ap.parse_args()
    print(json.dumps(train(args) if args.mode == "train" else eager(args)))


if __name__ == "__main__":
    main()
