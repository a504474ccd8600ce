"""Two real jax.distributed processes on 127.0.0.1 train like one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import torch2jax as t2j

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import gpt  # noqa: E402


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_losses(steps):
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)).to("jax")
    step, _ = gpt.adamw_step(model, t2j.jit)

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x, y = torch.randint(0, 96, (8, 32), generator=gen), torch.randint(0, 96, (8, 32), generator=gen)
        out.append(step(x, y).item())
    return out, {name: p.detach().cpu().double().sum().item() for name, p in model.named_parameters()}


def _run_two_processes(*extra):
    port = _free_port()
    script = os.path.join(ROOT, "examples", "train_multihost.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, script, "--process-id", str(i), "--num-processes", "2",
                               "--coordinator", f"127.0.0.1:{port}", *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process run timed out")
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["process"] for r in results) == [0, 1]
    assert all(r["processes"] == 2 and r["devices"] == 4 for r in results)
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["weight_sums"] == results[1]["weight_sums"]
    return results[0]


def test_two_processes_data_parallel_fsdp_match_one_process():
    result = _run_two_processes("--steps", "3")
    losses, sums = _single_process_losses(3)
    assert result["losses"] == pytest.approx(losses, abs=1e-4)
    # the parameters, FSDP-sharded over both processes' devices, read back whole by .cpu()
    assert result["weight_sums"] == pytest.approx(sums, abs=1e-3, rel=1e-5)


@pytest.mark.slow  # ~54 s; two processes training together stay in CI
def test_two_processes_save_sharded_checkpoint_and_resume_into_a_fresh_model(tmp_path):
    # 2 steps, orbax checkpoint written by both processes, a fresh model and AdamW
    # restored from it, 2 more steps: the same losses as 4 uninterrupted steps
    ckpt = tmp_path / "ckpt"
    result = _run_two_processes("--steps", "2", "--checkpoint", str(ckpt), "--resume-steps", "2")
    assert (ckpt / "torch2jax_structure.pkl").exists()
    assert result["losses"] == pytest.approx(_single_process_losses(4)[0], abs=1e-4)
