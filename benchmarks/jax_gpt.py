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


# -- the same GPT as plain functions over a parameter pytree, layers unrolled or scanned ----------------

_LINEARS = ("qkv", "proj", "fc", "fc_out")
_NORMS = ("ln_1", "ln_2")


def params_from_torch(torch_model, stacked: bool) -> dict:
    """The torch GPT's weights as a pytree: ``blocks`` is a list of per-layer dicts, or
    (``stacked``) one dict of arrays with a leading layer axis, as `lax.scan` takes them."""
    sd = {k: jnp.asarray(v.detach().cpu().numpy()) for k, v in torch_model.state_dict().items()}
    n = len(torch_model.blocks)
    blocks = []
    for i in range(n):
        p = f"blocks.{i}."
        blk = {name: {"w": sd[p + name + ".weight"].T, "b": sd[p + name + ".bias"]} for name in _LINEARS}
        blk.update({name: {"scale": sd[p + name + ".weight"], "bias": sd[p + name + ".bias"]} for name in _NORMS})
        blocks.append(blk)
    if stacked:
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return {"wte": sd["wte.weight"], "wpe": sd["wpe.weight"], "blocks": blocks,
            "ln_f": {"scale": sd["ln_f.weight"], "bias": sd["ln_f.bias"]}}


def _layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _block(p, x, n_head):
    b, t, c = x.shape
    q, k, v = jnp.split(_layer_norm(p["ln_1"], x) @ p["qkv"]["w"] + p["qkv"]["b"], 3, axis=-1)
    q, k, v = (z.reshape(b, t, n_head, c // n_head) for z in (q, k, v))
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, c)
    x = x + y @ p["proj"]["w"] + p["proj"]["b"]
    h = jax.nn.gelu(_layer_norm(p["ln_2"], x) @ p["fc"]["w"] + p["fc"]["b"], approximate=False)
    return x + h @ p["fc_out"]["w"] + p["fc_out"]["b"]


def loss_fn(params, idx, targets, n_head: int, scan: bool):
    """Mean cross-entropy of the GPT's next-token logits; its layers unrolled, or one `lax.scan`."""
    import optax

    x = params["wte"][idx] + params["wpe"][jnp.arange(idx.shape[1])]
    if scan:
        x, _ = jax.lax.scan(lambda h, p: (_block(p, h, n_head), None), x, params["blocks"])
    else:
        for p in params["blocks"]:
            x = _block(p, x, n_head)
    logits = _layer_norm(params["ln_f"], x) @ params["wte"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_step(n_head: int, scan: bool, lr: float = 1e-3):
    """``(step, optimizer)``: a jittable AdamW step ``step(params, opt_state, x, y) ->
    (params, opt_state, loss)`` with torch.optim.AdamW's defaults."""
    import optax

    opt = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, n_head, scan)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, opt
