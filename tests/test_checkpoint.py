"""t2j.save / t2j.load (orbax): resuming gives the same next losses as not stopping."""

from __future__ import annotations

import copy
import os
import sys

import torch

import torch2jax as t2j

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402


def _setup(base):
    model = copy.deepcopy(base).to("jax")
    step, opt = gpt.adamw_step(model, t2j.jit)
    return model, opt, step


def test_resume_from_checkpoint_matches_uninterrupted_training(tmp_path):
    torch.manual_seed(0)
    base = gpt.GPT(gpt.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 96, (8, 32), generator=g), torch.randint(0, 96, (8, 32), generator=g)) for _ in range(6)]
    _, _, step = _setup(base)
    uninterrupted = [step(*b).item() for b in data]

    model, opt, step = _setup(base)
    first = [step(*b).item() for b in data[:3]]
    t2j.save({"model": model, "optimizer": opt, "step": 3, "note": "halfway"}, str(tmp_path / "ckpt"))

    model2, opt2, step2 = _setup(base)
    state = t2j.load(str(tmp_path / "ckpt"), {"model": model2, "optimizer": opt2})
    assert state["step"] == 3 and state["note"] == "halfway" and state["model"] is model2
    for p, q in zip(model2.parameters(), model.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())
    resumed = first + [step2(*b).item() for b in data[3:]]
    assert resumed == uninterrupted


def test_plain_tensors_round_trip(tmp_path):
    t = {"w": torch.arange(6.0, device="jax").reshape(2, 3), "i": torch.tensor([1, 2]), "n": 7}
    t2j.save(t, str(tmp_path / "c"))
    back = t2j.load(str(tmp_path / "c"))
    assert back["w"].device.type == "jax" and back["w"].tolist() == t["w"].tolist()
    assert back["i"].dtype == torch.int64 and back["i"].tolist() == [1, 2] and back["n"] == 7
