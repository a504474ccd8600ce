"""Eager per-op overhead: torch2jax vs torch CPU vs calling jax.numpy directly vs torchax.

    python benchmarks/eager_overhead.py

Prints one table; every number comes from this one run, the columns of a row
timed in interleaved rounds (this machine is noisy, so compare the ratios, not
absolute times across runs). The last column compares main-thread CPU time, which
leaves out the time other processes hold the cores.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import torch

import torch2jax  # noqa: F401


def _time(fn, n):
    """(wall, main-thread CPU) seconds per call of ``fn``."""
    w, c = time.perf_counter(), time.thread_time()
    for _ in range(n):
        r = fn()
    if isinstance(r, torch2jax.Tensor):
        r.jax().block_until_ready()
    elif isinstance(r, jax.Array):
        r.block_until_ready()
    return (time.perf_counter() - w) / n, (time.thread_time() - c) / n


def bench(fns, n=1000, repeat=15):
    """Best wall and main-thread CPU time per call (us) of each of ``fns``, measured in
    interleaved rounds so that load from other processes hits every column alike (CPU
    time leaves out the time other processes hold the cores)."""
    for fn in fns.values():
        for _ in range(50):
            fn()
    wall = dict.fromkeys(fns, float("inf"))
    cpu = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            w, c = _time(fn, n)
            wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
    return {name: (wall[name] * 1e6, cpu[name] * 1e6) for name in fns}


def cases(device):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    if device != "cpu":
        a, b = a.to(device), b.to(device)
        mlp = mlp.to(device)
    return {
        "add 8x8": lambda: a + b,
        "mul 8x8": lambda: a * b,
        "matmul 8x8": lambda: a @ b,
        "MLP forward (8-32-8)": lambda: mlp(a),
    }


def jax_cases():
    key = jax.random.key(0)
    a, b = jax.random.normal(key, (8, 8)), jax.random.normal(jax.random.fold_in(key, 1), (8, 8))
    w1, w2 = jax.random.normal(key, (8, 32)), jax.random.normal(key, (32, 8))
    b1, b2 = jnp.zeros(32), jnp.zeros(8)
    return {
        "add 8x8": lambda: jnp.add(a, b),
        "mul 8x8": lambda: jnp.multiply(a, b),
        "matmul 8x8": lambda: jnp.matmul(a, b),
        "MLP forward (8-32-8)": lambda: jnp.maximum(a @ w1 + b1, 0) @ w2 + b2,
    }


def torchax_cases():
    try:
        import torchax  # noqa: F401
    except Exception as e:  # noqa: BLE001 - report why and skip
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return None, "torchax imported but is not wired into this benchmark"


def main():
    columns = {"torch2jax": cases("jax"), "torch CPU": cases("cpu"), "jax.numpy": jax_cases()}
    results = {c: {} for c in columns}
    for op in columns["torch2jax"]:
        for c, t in bench({c: columns[c][op] for c in columns}).items():
            results[c][op] = t
    _, torchax_note = torchax_cases()
    print(f"jax {jax.__version__}, torch {torch.__version__}, device {jax.devices()[0].platform}")
    print(f"torchax: skipped ({torchax_note})")
    print()
    print("| op | torch2jax (us) | torch CPU (us) | jax.numpy (us) | torch2jax / jax.numpy "
          "| main-thread CPU: torch2jax / jax.numpy |")
    print("|---|---|---|---|---|---|")
    for k in results["torch2jax"]:
        (t, tc), (c, _), (j, jc) = results["torch2jax"][k], results["torch CPU"][k], results["jax.numpy"][k]
        print(f"| {k} | {t:.1f} | {c:.1f} | {j:.1f} | {t / j:.2f}x | {tc / jc:.2f}x |")


if __name__ == "__main__":
    main()
