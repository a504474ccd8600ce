"""Device memory of a GPT training step with remat and host offload of saved activations.

    python benchmarks/offload_memory.py [--target cpu|tpu] [--topology v5e:2x2]
                                        [--layers 4] [--embd 256] [--seq 256] [--batch 32]

One examples/gpt.py AdamW step under `t2j.jit`, layers scanned (`t2j.use_scan_layers(model,
remat=...)`), compiled four ways: no remat, remat saving nothing, remat saving the matmul
outputs on the device, and remat offloading those outputs to host memory
(`t2j.offload.offload_policy()`). Columns: XLA's memory analysis of each compiled program
(device temporaries, host temporaries), all from this one run. Nothing is executed.

``--target tpu`` compiles ahead of time for a TPU topology through `step.lower_for` and
`jax.experimental.topologies`; it needs libtpu, not a TPU. Without installing it into the
environment (where JAX would try to start a TPU at every import):

    pip install --no-deps --target /tmp/libtpu "libtpu==0.0.42.*"   # the version jax[tpu] pins
    PYTHONPATH=/tmp/libtpu python benchmarks/offload_memory.py --target tpu

On the CPU backend a transfer between memory kinds compiles to nothing (there is one RAM),
so ``--target cpu`` shows no saving; the TPU compiler keeps offloaded buffers in host memory.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import gpt  # noqa: E402

import torch2jax as t2j  # noqa: E402
from torch2jax import offload  # noqa: E402

MiB = 2**20


def variants() -> dict:
    return {
        "no remat": None,
        "remat, save nothing": True,
        "remat, save dots on device (`dots_with_no_batch_dims_saveable`)":
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        "remat, offload dots to host (`t2j.offload.offload_policy()`)": offload.offload_policy(),
    }


def step_memory(cfg: gpt.GPTConfig, batch: int, remat, target) -> jax.stages.CompiledMemoryStats:
    torch.manual_seed(0)
    model = gpt.GPT(cfg).to("jax")
    t2j.use_scan_layers(model, remat=remat)
    step, _ = gpt.adamw_step(model, t2j.jit)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=torch.Generator().manual_seed(0))
    return step.lower_for(target, x, x).compile().memory_analysis()


def target_device(name: str, topology: str) -> jax.Device:
    if name == "cpu":
        return jax.devices("cpu")[0]
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology, platform="tpu").devices[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", choices=("cpu", "tpu"), default="cpu")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    cfg = gpt.GPTConfig(vocab_size=96, block_size=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.embd)
    device = target_device(a.target, a.topology)
    where = f"{device.device_kind} ({a.topology}, compiled ahead of time)" if a.target == "tpu" else "CPU"
    print(f"GPT {a.layers} layers, d={a.embd}, T={a.seq}, batch {a.batch}, AdamW under t2j.jit, layers scanned; "
          f"target {where}; jax {jax.__version__}, torch {torch.__version__}\n")
    print("| variant | device temp MiB | host temp MiB | device temp vs save dots |")
    print("|---|---|---|---|")
    rows = {name: step_memory(cfg, a.batch, remat, device) for name, remat in variants().items()}
    dots = rows["remat, save dots on device (`dots_with_no_batch_dims_saveable`)"].temp_size_in_bytes
    for name, m in rows.items():
        ratio = f"{m.temp_size_in_bytes / dots:.2f}x" if dots else ""
        print(f"| {name} | {m.temp_size_in_bytes / MiB:.1f} | {m.host_temp_size_in_bytes / MiB:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
