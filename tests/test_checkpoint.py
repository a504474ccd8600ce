"""t2j.save / t2j.load (orbax): resuming gives the same next losses as not stopping."""

from __future__ import annotations

import copy
import json
import os
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import torch2jax as t2j
from torch2jax.checkpoint import load_safetensors

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402


def _setup(base):
    model = copy.deepcopy(base).to("jax")
    step, opt = gpt.adamw_step(model, t2j.jit)
    return model, opt, step


@pytest.mark.slow  # ~30 s; test_programs.py::test_t2j_save_load_resumes_training covers resuming in CI
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
    # (the resumed step's first program, which creates the .grads, is compiled at XLA's lowest optimization
    # level, the uninterrupted one's fourth step is not: their roundings may differ in the last bit)
    assert resumed[:4] == uninterrupted[:4]
    torch.testing.assert_close(resumed, uninterrupted, rtol=1e-6, atol=0)


def test_plain_tensors_round_trip(tmp_path):
    t = {"w": torch.arange(6.0, device="jax").reshape(2, 3), "i": torch.tensor([1, 2]), "n": 7}
    t2j.save(t, str(tmp_path / "c"))
    back = t2j.load(str(tmp_path / "c"))
    assert back["w"].device.type == "jax" and back["w"].tolist() == t["w"].tolist()
    assert back["i"].dtype == torch.int64 and back["i"].tolist() == [1, 2] and back["n"] == 7


def test_names_that_differ_only_by_separators_keep_their_own_values(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])
            self.fc_1 = torch.nn.Linear(3, 3)  # ("fc.1.weight" and "fc_1.weight")

    torch.manual_seed(0)
    net = Net().to("jax")
    plain = {"a.b": torch.ones(2), "a_b": torch.zeros(2), "a/b": torch.full((2,), 2.0), "a": {"b": torch.full((2,), 3.0)}}
    t2j.save({"model": net, "plain": plain}, str(tmp_path / "ckpt"))
    torch.manual_seed(1)
    fresh = Net().to("jax")
    loaded = t2j.load(str(tmp_path / "ckpt"), {"model": fresh, "plain": None})
    for name, value in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[name].cpu(), value.cpu()), name
    got = loaded["plain"]
    assert [got[k].tolist() for k in ("a.b", "a_b", "a/b")] == [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]
    assert got["a"]["b"].tolist() == [3.0, 3.0]


def test_cpu_tensors_and_jax_arrays_come_back_as_they_were_saved(tmp_path):
    torch.manual_seed(3)
    state = {"rng": torch.get_rng_state(), "i": torch.tensor([1, 2]), "w": torch.ones(2, device="jax"),
             "a": jax.numpy.arange(3.0)}
    want = torch.rand(4)
    t2j.save(state, str(tmp_path / "c"))
    back = t2j.load(str(tmp_path / "c"))
    assert back["rng"].device.type == "cpu" and back["rng"].dtype == torch.uint8
    assert back["i"].device.type == "cpu" and back["w"].device.type == "jax"
    assert isinstance(back["a"], jax.Array) and back["a"].tolist() == [0.0, 1.0, 2.0]
    torch.set_rng_state(back["rng"])  # torch takes only a CPU ByteTensor here
    torch.testing.assert_close(torch.rand(4), want)


def test_optax_state_of_named_tuples_round_trips(tmp_path):
    # a named tuple (optax's ScaleByAdamState) was rebuilt from one generator argument: save raised a TypeError
    import optax

    params = {"w": jax.numpy.arange(3.0)}
    opt = optax.adam(0.1)
    state = opt.update(params, opt.init(params), params)[1]
    t2j.save({"opt": state, "step": 1}, str(tmp_path / "c"))
    back = t2j.load(str(tmp_path / "c"), {"opt": opt.init(params)})["opt"]
    assert type(back[0]) is type(state[0]) and type(back[1]) is type(state[1])
    assert int(back[0].count) == 1 and back[0].mu["w"].tolist() == state[0].mu["w"].tolist()


def test_jax_pytree_nodes_are_saved_through_orbax(tmp_path):
    # a flax nnx State or an equinox module was pickled whole into the structure file: not orbax's sharded,
    # per-process arrays, and placed on one device at load whatever the target
    import equinox as eqx
    from flax import nnx

    state = nnx.state(nnx.Linear(64, 32, rngs=nnx.Rngs(0)))
    layer = eqx.nn.Linear(64, 32, key=jax.random.key(0))
    t2j.save({"nnx": state, "eqx": layer}, str(tmp_path / "c"))
    assert os.path.getsize(tmp_path / "c" / "torch2jax_structure.pkl") < 2000  # (the arrays are orbax's)
    back = t2j.load(str(tmp_path / "c"), {"nnx": state, "eqx": layer})
    for name, tree in (("nnx", state), ("eqx", layer)):
        assert jax.tree.structure(back[name]) == jax.tree.structure(tree)
        for a, b in zip(jax.tree.leaves(back[name]), jax.tree.leaves(tree)):
            np.testing.assert_array_equal(a, b)


def test_empty_tensors_complex32_and_states_without_tensors_round_trip(tmp_path):
    m = torch.nn.Linear(2, 2).to("jax")
    m.register_buffer("cache", torch.zeros(0, 3, device="jax"))
    z = torch.ones(2, dtype=torch.complex32, device="jax")
    state = {"model": m, "z": z, "none": torch.zeros(0, dtype=torch.int64)}
    t2j.save(state, str(tmp_path / "a"))
    fresh = torch.nn.Linear(2, 2).to("jax")
    fresh.register_buffer("cache", torch.ones(0, 3, device="jax"))
    back = t2j.load(str(tmp_path / "a"), {"model": fresh})
    assert fresh.cache.shape == (0, 3) and fresh.cache.device.type == "jax"
    torch.testing.assert_close(fresh.weight.cpu(), m.weight.cpu())
    assert back["z"].dtype == torch.complex32 and back["z"].cpu().tolist() == [1 + 0j, 1 + 0j]
    assert back["none"].dtype == torch.int64 and back["none"].shape == (0,) and back["none"].device.type == "cpu"
    # (an optimizer before its first step holds no tensor)
    opt = torch.optim.Adam(m.parameters(), lr=0.5)
    t2j.save({"step": 3, "optimizer": opt}, str(tmp_path / "b"))
    again = torch.optim.Adam(m.parameters(), lr=0.1)
    assert t2j.load(str(tmp_path / "b"), {"optimizer": again})["step"] == 3
    assert again.param_groups[0]["lr"] == 0.5


# -- safetensors -------------------------------------------------------------------

transformers.logging.set_verbosity_error()


def _gpt2(seed):
    cfg = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama(seed):
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2_tied", "llama"])
def test_safetensors_into_a_fresh_hf_model_gives_the_same_logits(tmp_path, make):
    original = make(0)
    original.save_pretrained(tmp_path, safe_serialization=True)
    fresh = make(1).to("jax")
    assert load_safetensors(tmp_path, model=fresh) is fresh
    ids = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids.to("jax")).logits.cpu(), original(ids).logits)
    if make is _gpt2:
        assert fresh.lm_head.weight is fresh.transformer.wte.weight  # tied weights stay one tensor
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")


def test_sharded_safetensors_with_an_index(tmp_path):
    original = _llama(0)
    original.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    assert index.exists() and len(set(json.loads(index.read_text())["weight_map"].values())) > 2
    expected = original.state_dict()
    for source in (tmp_path, index):
        fresh = _llama(1).to("jax")
        load_safetensors(source, model=fresh)
        for k, v in fresh.state_dict().items():
            torch.testing.assert_close(v.cpu(), expected[k], rtol=0, atol=0, msg=k)
    shards = sorted(str(p) for p in tmp_path.glob("model-*.safetensors"))
    state = load_safetensors(shards)
    assert set(state) == set(expected)


def test_safetensors_state_dict_keeps_dtypes(tmp_path):
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(4).half(),
        "i64": torch.tensor([2**40, -3]),
        "f64": torch.randn(2, dtype=torch.float64),
        "bool": torch.tensor([True, False]),
        "u8": torch.arange(7, dtype=torch.uint8),
        "f8": torch.randn(6).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(1.5),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    state = load_safetensors(tmp_path / "t.safetensors")
    assert set(state) == set(tensors)
    for k, expected in tensors.items():
        got = state[k]
        assert isinstance(got, t2j.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape, k
        assert torch.equal(got.cpu().reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), k
    assert state["bf16"].jax().dtype == ml_dtypes.bfloat16


def test_safetensors_into_a_meta_model(tmp_path):
    original = _gpt2(0)
    original.save_pretrained(tmp_path, safe_serialization=True)
    with torch.device("meta"):
        model = _gpt2(1)
    load_safetensors(tmp_path, model=model)
    assert all(isinstance(p, torch.nn.Parameter) and p.device.type == "jax" for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids.to("jax")).logits.cpu(), original(ids).logits)


def test_safetensors_casts_to_the_model_dtype(tmp_path):
    original = _llama(0).to(torch.bfloat16)
    original.save_pretrained(tmp_path, safe_serialization=True)
    fresh = _llama(1).to("jax")
    load_safetensors(tmp_path, model=fresh)
    w = fresh.model.embed_tokens.weight
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.cpu(), original.model.embed_tokens.weight.float(), rtol=0, atol=0)


def test_safetensors_key_and_shape_errors(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to("jax")
    good = {k: v.cpu() for k, v in model.state_dict().items()}
    save_file({k: v for k, v in good.items() if k != "1.bias"} | {"extra.weight": torch.ones(2)}, tmp_path / "a.safetensors")
    with pytest.raises(RuntimeError, match=r"load_safetensors: .*missing keys 1\.bias; unexpected keys extra\.weight"):
        load_safetensors(tmp_path / "a.safetensors", model=model)
    load_safetensors(tmp_path / "a.safetensors", model=model, strict=False)
    torch.testing.assert_close(model[0].weight.cpu(), good["0.weight"])
    save_file(good | {"0.weight": torch.ones(4, 4)}, tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match=r"'0\.weight' has shape \[4, 4\] in the checkpoint but \[4, 3\] in the model"):
        load_safetensors(tmp_path / "b.safetensors", model=model)


def test_safetensors_bad_input_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="load_safetensors: no model.safetensors.index.json or model.safetensors"):
        load_safetensors(tmp_path)
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
    with pytest.raises(ValueError, match="junk.safetensors is not a safetensors file"):
        load_safetensors(tmp_path / "junk.safetensors")
    with pytest.raises(TypeError, match="load_safetensors: expected a path"):
        load_safetensors(3)
    save_file({"a": torch.ones(2)}, tmp_path / "one.safetensors")
    with pytest.raises(ValueError, match="load_safetensors: device must be 'jax'"):
        load_safetensors(tmp_path / "one.safetensors", device="cuda")
    with pytest.raises(ValueError, match="tensor 'a' is in both"):
        load_safetensors([tmp_path / "one.safetensors", tmp_path / "one.safetensors"])
    assert np.asarray(load_safetensors(tmp_path / "one.safetensors", device=jax.devices()[-1])["a"].jax()).tolist() == [1, 1]
