"""The example scripts a user copies from run end to end (small settings, fresh processes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import torch2jax  # noqa: F401 - torch.load of jax-device tensors needs torch2jax's rebuild function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_train_gpt_trains_saves_and_samples(tmp_path):
    out = _run("train_gpt.py", "--steps", "30", "--layers", "1", "--embd", "32", "--heads", "2", "--block", "32",
               "--batch", "8", "--out", str(tmp_path))
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first
    # the first step creates .grad and the optimizer state, every later step reuses the second program
    assert int(re.search(r"(\d+) traces", out).group(1)) == 2
    assert (tmp_path / "loss.png").stat().st_size > 0
    state = torch.load(tmp_path / "checkpoint.pt", map_location="cpu")
    assert state, "empty checkpoint"
    assert re.search(r"sample: .{20,}", out, re.S)


def test_quickstart():
    out = _run("quickstart.py")
    assert float(re.search(r"accuracy ([\d.]+)", out).group(1)) > 0.9


@pytest.mark.slow  # ~28 s; tests/test_parallel.py covers FSDP x TP in CI
def test_fsdp_tp_matches_one_device():
    out = _run("fsdp_tp.py", "--steps", "3")
    assert float(re.search(r"max difference over all steps: (\S+)", out).group(1)) < 1e-4


@pytest.mark.slow  # ~27 s; tests/test_control_flow.py covers use_scan_layers in CI
def test_scan_layers_example_matches_unrolled():
    out = _run("scan_layers.py", "--layers", "2", "--steps", "2")
    unrolled = json.loads(re.search(r"losses unrolled:\s+(\[.*\])", out).group(1))
    scanned = json.loads(re.search(r"losses scan_layers:\s+(\[.*\])", out).group(1))
    assert len(unrolled) == 2 and unrolled == pytest.approx(scanned, abs=1e-3)


@pytest.mark.slow  # ~15 s; tests/test_dynamo.py covers the backend in CI
def test_torch_compile_example_trains():
    out = _run("torch_compile.py")
    assert float(re.search(r"final loss ([\d.]+)", out).group(1)) < 0.1


@pytest.mark.slow  # ~20 s; the offload mechanisms themselves are tested by default in tests/test_offload.py
def test_host_offload_example_trains_like_saving_on_the_device():
    out = _run("host_offload.py", "--layers", "2", "--embd", "32", "--seq", "16", "--batch", "2", "--steps", "2")
    assert float(re.search(r"max loss difference between the two: (\S+)", out).group(1)) < 1e-5
    assert "EMA weights live in memory kind 'pinned_host'" in out
    assert float(re.search(r"activations moved to host per step: (\S+) MiB", out).group(1)) > 0


@pytest.mark.slow
def test_export_example_runs_the_deserialized_program_at_several_shapes():
    out = _run("export_stablehlo.py")
    diffs = [float(d) for d in re.findall(r"max difference to torch (\S+)", out)]
    assert len(diffs) == 3 and max(diffs) < 1e-4


@pytest.mark.slow
def test_debugging_example_loads_safetensors_counts_and_profiles():
    out = _run("debugging.py")
    assert "weights equal True, lm_head tied to wte True" in out
    assert "'host_fallbacks': 0" in out and "'traces': 3" in out
    assert "[2, 16] -> torch.int64 [2, 8]" in out
    assert int(re.search(r"profiler trace: (\d+) xplane", out).group(1)) >= 1
