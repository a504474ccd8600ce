"""Deep models compile once per layer: an HF Llama trained with its layer loop as one lax.scan.

    python examples/scan_layers.py [--layers 12] [--steps 5]

`t2j.use_scan_layers(model)` makes the model's own `for layer in self.layers` run
all layers as a single `lax.scan` over their stacked parameters (optionally
rematerialized), so the layers are traced once, whatever the depth. With
``stack_parameters=True`` the parameters are also stored stacked (one Parameter
per name, as a JAX model keeps them), so AdamW updates a dozen tensors rather than
a dozen per layer; the state dict keeps the usual per-layer names. The training
step is one `t2j.jit` program and its losses match the unrolled model's (see
benchmarks/RESULTS.md for compile and step times).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

import torch2jax as t2j


def run(model, steps, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @t2j.jit
    def step(ids):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        return loss

    start = time.perf_counter()
    losses = [step(ids).item() for _ in range(2)]
    first = time.perf_counter() - start
    losses += [step(ids).item() for _ in range(steps - 2)]
    return losses, first, step.stats["traces"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=args.layers)
    base = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (4, 32))

    unrolled, t_unrolled, _ = run(copy.deepcopy(base).to("jax"), args.steps, ids)
    scanned_model = t2j.use_scan_layers(copy.deepcopy(base).to("jax"), remat=True, stack_parameters=True)
    scanned_model.load_state_dict(base.state_dict())  # per-layer checkpoints load as they are
    scanned, t_scanned, traces = run(scanned_model, args.steps, ids)
    print(f"{args.layers}-layer Llama: first two steps (trace + compile) unrolled {t_unrolled:.1f} s, "
          f"scan_layers (stacked parameters) + remat {t_scanned:.1f} s")
    print("losses unrolled:   ", [round(v, 4) for v in unrolled])
    print("losses scan_layers:", [round(v, 4) for v in scanned])


if __name__ == "__main__":
    main()
