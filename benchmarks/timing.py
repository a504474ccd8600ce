"""Timing helpers shared by the eager benchmarks (no torch2jax import: torchax's process uses them too)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def _time(fn, n):
    """(wall, main-thread CPU) seconds per call of ``fn``."""
    w, c = time.perf_counter(), time.thread_time()
    for _ in range(n):
        r = fn()
    if hasattr(r, "jax"):  # a torch2jax or torchax tensor
        r = r.jax()
    if isinstance(r, jax.Array):
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
