"""Peak host memory of loading a ~100 MB safetensors file into jax tensors.

    python benchmarks/safetensors_memory.py [--mb 100]

Each way of loading runs in a fresh process; the number is the peak resident set
size during the load minus the resident size just before it (``ru_maxrss``), so
it counts the loaded arrays themselves (on the CPU backend jax arrays live in host
memory) plus every temporary copy:

- ``t2j.load_safetensors``: one tensor at a time from the file into a jax array;
- ``safetensors.torch.load_file`` then ``.to("jax")``: the whole state dict in
  torch CPU memory first;
- ``torch.load`` of the same tensors saved as a ``.pt`` file, then ``.to("jax")``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_LOADERS = {
    "t2j.load_safetensors": "state = load_safetensors(path)",
    "safetensors.torch.load_file + .to('jax')": (
        "from safetensors.torch import load_file\n"
        "cpu = load_file(path)\n"
        "state = {k: v.to('jax') for k, v in cpu.items()}\n"
        "del cpu"
    ),
    "torch.load + .to('jax')": (
        "cpu = torch.load(path[:-len('.safetensors')] + '.pt')\n"
        "state = {k: v.to('jax') for k, v in cpu.items()}\n"
        "del cpu"
    ),
}

_CHILD = """
import json, resource, sys
import jax, torch
import torch2jax as t2j
from torch2jax.checkpoint import load_safetensors

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

(torch.ones(4, device="jax") * 2).cpu()  # start the runtime before measuring
path = sys.argv[1]
before = rss_mb()
{loader}
jax.block_until_ready([t.jax() for t in state.values()])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"before": before, "peak": peak}}))
"""


def _write(folder, mb):
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    n = mb * 2**20 // (4 * 2**20)  # 4 MiB float32 tensors
    tensors = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(n)}
    path = os.path.join(folder, "model.safetensors")
    save_file(tensors, path)
    torch.save(tensors, os.path.join(folder, "model.pt"))
    return path, sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path, size = _write(folder, args.mb)
        print(f"file: {size:.0f} MiB of float32 tensors (4 MiB each)")
        for name, loader in _LOADERS.items():
            code = _CHILD.format(loader=loader)
            out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            extra = r["peak"] - r["before"]
            print(f"{name:45s} peak host memory during the load: +{extra:6.0f} MiB ({extra / size:.2f}x the file)")


if __name__ == "__main__":
    main()
