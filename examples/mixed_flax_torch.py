"""One model, three frameworks: a torch embedding, a flax nnx transformer block and an
equinox head, trained end to end by torch.optim.AdamW in one `t2j.jit` step.

    python examples/mixed_flax_torch.py

The nnx block and the equinox head become torch modules (`t2j.modules.from_nnx`,
`t2j.modules.from_equinox`): their arrays are torch parameters on the jax device,
torch autograd differentiates through them (JAX's VJP) and AdamW updates them with
the torch parameters. After training, `.to_jax()` hands the trained JAX modules back.
"""

from __future__ import annotations

import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import torch
import torch.nn as nn
import torch.nn.functional as F
from flax import nnx

import torch2jax as t2j

sys.path.insert(0, os.path.dirname(__file__))
from gpt import CharData, make_text  # noqa: E402

BLOCK, DIM, HEADS = 32, 64, 4


class NnxBlock(nnx.Module):
    """A pre-norm causal self-attention + MLP block written in flax nnx."""

    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.out = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class Mixed(nn.Module):
    """torch embeddings -> nnx block -> equinox head (per token, vmapped)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, DIM)
        self.pos = nn.Embedding(BLOCK, DIM)
        self.block = t2j.modules.from_nnx(NnxBlock(DIM, HEADS, nnx.Rngs(0)))
        self.head = t2j.modules.from_equinox(eqx.nn.MLP(DIM, vocab, DIM, 1, key=jax.random.key(1)), vmap=True)

    def forward(self, idx):
        b, t = idx.shape
        h = self.block(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        return self.head(h.reshape(b * t, DIM)).reshape(b, t, -1)


def main(steps: int = 200, batch: int = 16):
    torch.manual_seed(0)
    data = CharData(make_text(2000), BLOCK)
    model = Mixed(data.vocab_size).to("jax")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    @t2j.jit
    def step(x, y):
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss

    g = torch.Generator().manual_seed(0)
    losses = []
    for i in range(steps):
        x, y = data.batch(batch, g)
        losses.append(step(x, y).item())
        if i % 20 == 0 or i == steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.4f}")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {step.stats['traces']} traces, {step.stats['compiles']} compiles")

    # The trained JAX modules, used from plain JAX: the same logits as the torch model.
    block, head = model.block.to_jax(), model.head.to_jax()
    x, _ = data.batch(2, g)
    with torch.no_grad():
        expected = model(x.to("jax")).jax()
        h = (model.tok(x.to("jax")) + model.pos(torch.arange(BLOCK, device="jax"))).jax()
    logits = jax.vmap(jax.vmap(head))(block(h))
    print(f"pure JAX forward with the trained nnx block and equinox head matches: "
          f"{bool(jnp.allclose(logits, expected, atol=1e-4))}")
    return losses


if __name__ == "__main__":
    main()
