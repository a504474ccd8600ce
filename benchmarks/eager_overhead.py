"""Eager per-op overhead: torch2jax vs torch CPU vs calling jax.numpy directly vs torchax.

    python benchmarks/eager_overhead.py

Prints one table; every number comes from this one run, the columns of a row
timed in interleaved rounds (this machine is noisy, so compare the ratios, not
absolute times across runs). The last column compares main-thread CPU time, which
leaves out the time other processes hold the cores. torchax cannot share a process
with torch2jax (both register the "jax" device), so its rows are timed in a process
of their own (`torchax_rows.py eager`) against the same jax.numpy calls there.
"""

from __future__ import annotations

import os
import sys

import jax
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch2jax  # noqa: E402, F401
import torchax_rows  # noqa: E402
from common import bench, jax_cases  # noqa: E402


def cases(device):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    labels, ids = torch.randint(0, 8, (8,), generator=g), torch.randint(0, 100, (16,), generator=g)
    table = torch.randn(100, 8, generator=g)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    if device != "cpu":
        a, b, labels, ids, table = (t.to(device) for t in (a, b, labels, ids, table))
        mlp = mlp.to(device)
    return {
        "add 8x8": lambda: a + b,
        "mul 8x8": lambda: a * b,
        "matmul 8x8": lambda: a @ b,
        "MLP forward (8-32-8)": lambda: mlp(a),
        "cross_entropy 8x8": lambda: torch.nn.functional.cross_entropy(a, labels),
        "embedding 16 of 100x8": lambda: torch.nn.functional.embedding(ids, table),
        "dropout 8x8": lambda: torch.nn.functional.dropout(a, 0.1, True),
    }


def main():
    columns = {"torch2jax": cases("jax"), "torch CPU": cases("cpu"), "jax.numpy": jax_cases()}
    results = {c: {} for c in columns}
    for op in columns["torch2jax"]:
        for c, t in bench({c: columns[c][op] for c in columns}).items():
            results[c][op] = t
    torchax = torchax_rows.run("eager")
    print(f"jax {jax.__version__}, torch {torch.__version__}, device {jax.devices()[0].platform}")
    if "note" in torchax:
        print(f"torchax: skipped ({torchax['note']})")
    print()
    print("| op | torch2jax (us) | torch CPU (us) | jax.numpy (us) | torch2jax / jax.numpy "
          "| main-thread CPU: torch2jax / jax.numpy | torchax (us) | torchax / jax.numpy |")
    print("|---|---|---|---|---|---|---|---|")
    for k in results["torch2jax"]:
        (t, tc), (c, _), (j, jc) = results["torch2jax"][k], results["torch CPU"][k], results["jax.numpy"][k]
        tx = torchax.get("rows", {}).get(k)
        tx = f"{tx['us']:.1f} | {tx['vs_jnp']:.2f}x" if tx else " | "
        print(f"| {k} | {t:.1f} | {c:.1f} | {j:.1f} | {t / j:.2f}x | {tc / jc:.2f}x | {tx} |")


if __name__ == "__main__":
    main()
