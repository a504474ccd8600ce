"""The GPT of examples/gpt.py written by hand in flax.nnx: the pure-JAX reference.

Same architecture, same sizes, same initialization scheme (weights are copied
from the torch model so both start from the same point).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Block(nnx.Module):
    def __init__(self, d, n_head, rngs):
        self.n_head = n_head
        self.ln_1 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.fc_out = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        b, t, c = x.shape
        q, k, v = jnp.split(self.qkv(self.ln_1(x)), 3, axis=-1)
        q, k, v = (z.reshape(b, t, self.n_head, c // self.n_head) for z in (q, k, v))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc_out(jax.nn.gelu(self.fc(self.ln_2(x)), approximate=False))


class GPT(nnx.Module):
    def __init__(self, cfg, rngs):
        d = cfg.n_embd
        self.wte = nnx.Embed(cfg.vocab_size, d, rngs=rngs)
        self.wpe = nnx.Embed(cfg.block_size, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, cfg.n_head, rngs) for _ in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)

    def __call__(self, idx):
        x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.wte.attend(self.ln_f(x))  # tied head


def load_from_torch(model: GPT, torch_model) -> None:
    """Copy the torch GPT's weights (examples/gpt.py) into the flax one."""
    sd = {k: np.asarray(v.detach().cpu().numpy()) for k, v in torch_model.state_dict().items()}
    model.wte.embedding.value = jnp.asarray(sd["wte.weight"])
    model.wpe.embedding.value = jnp.asarray(sd["wpe.weight"])
    for i, blk in enumerate(model.blocks):
        p = f"blocks.{i}."
        for name in ("qkv", "proj", "fc", "fc_out"):
            lin = getattr(blk, name)
            lin.kernel.value = jnp.asarray(sd[p + name + ".weight"].T)
            lin.bias.value = jnp.asarray(sd[p + name + ".bias"])
        for name in ("ln_1", "ln_2"):
            ln = getattr(blk, name)
            ln.scale.value = jnp.asarray(sd[p + name + ".weight"])
            ln.bias.value = jnp.asarray(sd[p + name + ".bias"])
    model.ln_f.scale.value = jnp.asarray(sd["ln_f.weight"])
    model.ln_f.bias.value = jnp.asarray(sd["ln_f.bias"])
