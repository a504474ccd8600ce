"""Train a small model with ``torch.compile(model, backend="torch2jax")``.

Dynamo captures the forward, AOTAutograd splits it into a forward and a backward
ATen graph, and torch2jax runs each as one jitted JAX (XLA) program;
``loss.backward()`` and ``torch.optim.AdamW`` work as usual. The model, the data
and the optimizer are plain torch, first on the CPU, then on the jax device
(``model.to("jax")``), where the optimizer step is compiled too.

    python examples/torch_compile.py
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2jax  # noqa: F401 - the "torch2jax" backend itself is found through the package's entry point


def make_data(n=512, dim=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 2
    labels = torch.randint(0, classes, (n,), generator=g)
    return centers[labels] + torch.randn(n, dim, generator=g), labels


def train(model, device, steps=60, batch=64, lr=3e-3):
    """AdamW on a toy classification task on ``device``; returns (losses, seconds per step
    after the first two, which compile)."""
    model.to(device)
    x, y = make_data()
    # batches as a data loader hands them over: fresh tensors on the device
    batches = [(x[i:i + batch].to(device), y[i:i + batch].to(device)) for i in range(0, len(x), batch)]
    compiled = torch.compile(model, backend="torch2jax")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # on the jax device an eager step runs op by op; compiled, it is one more JAX program
    opt_step = torch.compile(opt.step, backend="torch2jax") if device == "jax" else opt.step
    losses, start = [], None
    for step in range(steps):
        inputs, labels = batches[step % len(batches)]
        opt.zero_grad()
        loss = F.cross_entropy(compiled(inputs), labels)
        loss.backward()
        opt_step()
        losses.append(loss.item())
        if step == 1:
            start = time.perf_counter()
    return losses, (time.perf_counter() - start) / (steps - 2)


def main():
    for device in ("cpu", "jax"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
        losses, per_step = train(model, device)
        print(f"-- {device}")
        for step in range(0, len(losses), 20):
            print(f"step {step:3d}  loss {losses[step]:.4f}")
        print(f"final loss {losses[-1]:.4f}; {per_step * 1e3:.2f} ms per step after compilation")


if __name__ == "__main__":
    main()
