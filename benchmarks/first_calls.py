"""The first two calls of a jitted GPT training step: what compiling the first program (which creates
``.grad`` and the optimizer state, so its second call traces and compiles the steady-state one) at XLA's
lowest backend optimization level saves, against compiling it as every other program.

    python benchmarks/first_calls.py [--rounds 2] [--layers 4] [--embd 128]

Both ways run in this one process, interleaved round by round; the losses of the two calls must agree.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import gpt  # noqa: E402

import torch2jax as t2j  # noqa: E402

_jit = sys.modules["torch2jax.jit"]
_FIRST_ENTRY = _jit.JitFunction._first_entry


def first_two_calls(base, x, y, once: bool):
    """Seconds of the first and the second call (trace, compile and run) and their losses."""
    _jit.JitFunction._first_entry = staticmethod(_FIRST_ENTRY if once else (lambda entry: None))
    try:
        step, _ = gpt.adamw_step(copy.deepcopy(base).to("jax"), t2j.jit)
        xj, yj = x.to("jax"), y.to("jax")
        times, losses = [], []
        for _ in range(2):
            t = time.perf_counter()
            losses.append(step(xj, yj).item())
            times.append(time.perf_counter() - t)
        return times, losses
    finally:
        _jit.JitFunction._first_entry = _FIRST_ENTRY


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = gpt.GPT(gpt.GPTConfig(n_layer=args.layers, n_embd=args.embd, n_head=4))
    x, y = torch.randint(0, 96, (8, 64)), torch.randint(0, 96, (8, 64))
    print("| round | first program | call 1 s | call 2 s | both s | losses |")
    print("|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for once in (True, False):
            (t1, t2), losses = first_two_calls(base, x, y, once)
            label = "lowest optimization level" if once else "as every program"
            print(f"| {r + 1} | {label} | {t1:.2f} | {t2:.2f} | {t1 + t2:.2f} | {losses[0]:.6f}, {losses[1]:.6f} |")


if __name__ == "__main__":
    main()
