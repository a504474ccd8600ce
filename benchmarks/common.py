"""What the benchmarks share: timing helpers, the GPT problem of the training-step rows. No torch2jax import:
torchax's process (torchax_rows.py) uses it too."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import torch


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
    labels, ids = jax.random.randint(key, (8,), 0, 8), jax.random.randint(key, (16,), 0, 100)
    table = jax.random.normal(key, (100, 8))
    stream = [jax.random.key(1)]

    def dropout():
        stream[0], sub = jax.random.split(stream[0])
        return jnp.where(jax.random.bernoulli(sub, 0.9, a.shape), a / 0.9, 0)

    return {
        "add 8x8": lambda: jnp.add(a, b),
        "mul 8x8": lambda: jnp.multiply(a, b),
        "matmul 8x8": lambda: jnp.matmul(a, b),
        "MLP forward (8-32-8)": lambda: jnp.maximum(a @ w1 + b1, 0) @ w2 + b2,
        "cross_entropy 8x8": lambda: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(a), labels[:, None], 1)),
        "embedding 16 of 100x8": lambda: table[ids],
        "dropout 8x8": dropout,
    }


def set_matmul_precision(precision: str):
    """The same float32 matmul precision for torch and JAX: "highest" (full float32, torch's default)
    or "high" (TF32 passes on GPUs that have them)."""
    torch.set_float32_matmul_precision(precision)
    jax.config.update("jax_default_matmul_precision", "highest" if precision == "highest" else "tensorfloat32")


def gpt_problem(args):
    """The GPT of examples/gpt.py sized by ``args`` (layers, embd, heads, seq), seeded weights and
    ``args.steps + 2`` batches of (batch, seq) token ids: the same in every process."""
    import gpt

    cfg = gpt.GPTConfig(vocab_size=96, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g),
                torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)) for _ in range(args.steps + 2)]
    return cfg, model, batches


def add_gpt_arguments(ap):
    """The command-line options of `gpt_problem` and `set_matmul_precision` on parser ``ap``."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--matmul-precision", choices=("highest", "high"), default="highest",
                    help="float32 matmuls in every row: 'highest' (torch's default: full float32) or 'high' "
                         "(TF32 passes on GPUs that have them); sets torch.set_float32_matmul_precision and "
                         "JAX's jax_default_matmul_precision alike")
