"""Load HF weights from safetensors, then see what torch2jax does with the training step.

    python examples/debugging.py [--trace-dir /tmp/t2j-trace]

- `t2j.load_safetensors` reads a `save_pretrained` checkpoint straight into a GPT-2 on
  the jax device, one tensor at a time (tied weights stay tied);
- `t2j.debug.op_report` lists the ops of a forward pass that were decomposed or ran
  on the host;
- `t2j.debug.counters` counts traces, compiles and cache hits of a `t2j.jit` step, and
  `t2j.explain_recompiles` says why it traced again (a new sequence length);
- `t2j.debug.profile` writes a JAX profiler trace of a few steps, with the forward
  pass named by `t2j.debug.annotate`.

Set ``TORCH2JAX_LOG=ops`` (every op as it is dispatched) or ``TORCH2JAX_LOG=recompiles``
to watch the same from the logs.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import transformers

import torch2jax as t2j


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace-dir", help="where to write the profiler trace (default: a temporary directory)")
    a = ap.parse_args()
    transformers.logging.set_verbosity_error()

    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    trained = transformers.GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as tmp:
        trained.save_pretrained(tmp)  # model.safetensors, as a downloaded checkpoint
        model = t2j.load_safetensors(tmp, model=transformers.GPT2LMHeadModel(config).to("jax"))
    same = all(torch.equal(p.detach().cpu(), q.detach()) for p, q in zip(model.parameters(), trained.parameters()))
    print(f"loaded from safetensors: weights equal {same}, "
          f"lm_head tied to wte {model.lm_head.weight is model.transformer.wte.weight}")

    ids = torch.randint(0, config.vocab_size, (2, 16)).to("jax")
    with t2j.debug.op_report() as report:
        model(ids, labels=ids).loss.backward()
    print(report)
    model.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @t2j.jit
    def step(ids):
        opt.zero_grad()
        with t2j.debug.annotate("forward"):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    t2j.debug.reset_counters()
    for _ in range(3):
        step(ids)
    step(ids[:, :8])  # a new shape: one more trace
    print("counters:", t2j.debug.counters())
    print("last recompile:", t2j.explain_recompiles()[-1])

    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="t2j-trace-")
    with t2j.debug.profile(trace_dir):
        for _ in range(2):
            loss = step(ids)
    traces = [f for _, _, files in os.walk(trace_dir) for f in files if f.endswith(".xplane.pb")]
    print(f"profiler trace: {len(traces)} xplane file(s) under {trace_dir}; last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
