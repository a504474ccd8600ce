"""Export an HF GPT-2 to StableHLO with a symbolic batch and sequence length, and run it without torch.

    python examples/export_stablehlo.py [--out gpt2.jax_exported]

`t2j.export` traces the model once through torch.export and returns a
`jax.export.Exported` whose batch and sequence dimensions stay symbolic (from
torch.export `Dim`s). Its StableHLO is printed, it is serialized to bytes (what a
serving process would load), loaded back and called at several shapes with plain
JAX arrays: parameters, RNG key and token ids in; logits, buffers and the new key
out. The logits match torch on the CPU.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from jax import export as jax_export
from torch.export import Dim

import torch2jax as t2j


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="also write the serialized program to this file")
    a = ap.parse_args()

    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 8))

    batch, seq = Dim("batch", max=16), Dim("seq", max=64)
    exported = t2j.export(model, ids, dynamic_shapes={"input_ids": {0: batch, 1: seq}}, use_cache=False)
    print("input shapes:", [str(a.shape) for a in exported.in_avals][-1])
    text = exported.mlir_module()
    main_fn = next(line.strip() for line in text.splitlines() if "func.func public @main" in line)
    print(f"StableHLO: {len(text.splitlines())} lines; {main_fn[:160]}...")

    blob = exported.serialize()
    if a.out:
        with open(a.out, "wb") as f:
            f.write(blob)
    print(f"serialized: {len(blob) / 1024:.0f} KiB")

    # what a process without torch does: the bytes, the parameters as arrays, a key
    loaded = jax_export.deserialize(blob)
    _, state = t2j.functionalize(model)
    params = jax.tree.map(jnp.asarray, state)
    for shape in [(1, 5), (3, 17), (2, 64)]:
        x = np.random.default_rng(0).integers(0, config.vocab_size, shape)
        out, _, _ = loaded.call(params, jax.random.key(0), jnp.asarray(x, loaded.in_avals[-1].dtype))
        with torch.no_grad():
            expected = model(torch.from_numpy(x), use_cache=False).logits.numpy()
        logits = np.asarray(out["logits"])  # a ModelOutput is exported as a plain dict
        print(f"batch {shape[0]}, sequence {shape[1]}: logits {logits.shape}, "
              f"max difference to torch {np.abs(logits - expected).max():.2e}")


if __name__ == "__main__":
    main()
