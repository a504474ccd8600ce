"""t2j.export: StableHLO that runs without torch, with state, buffers and RNG explicit."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import torch2jax as t2j


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))


def test_export_eval_matches_torch_and_round_trips_through_bytes():
    model = _model().eval()
    x = torch.randn(6, 16)
    exported = t2j.export(model, x)
    assert "stablehlo" in exported.mlir_module() or "func.func" in exported.mlir_module()
    _, state = t2j.functionalize(model)
    out, _, _ = exported.call(state, jax.random.key(0), x.numpy())
    np.testing.assert_allclose(out, model(x).detach().numpy(), atol=1e-5)
    restored = jax.export.deserialize(exported.serialize())
    out2, _, _ = jax.jit(restored.call)(state, jax.random.key(0), x.numpy())
    np.testing.assert_array_equal(out, out2)


def test_export_train_mode_returns_buffers_and_advances_the_key():
    model = _model().train()
    x = torch.randn(6, 16)
    exported = t2j.export(model, x)
    _, state = t2j.functionalize(model)
    key = jax.random.key(1)
    out_a, buffers, key_a = exported.call(state, key, x.numpy())
    out_b, _, _ = exported.call(state, key_a, x.numpy())
    assert int(buffers["1.num_batches_tracked"]) == 1
    expected_mean = 0.1 * model[0](x).mean(0).detach().numpy()
    np.testing.assert_allclose(buffers["1.running_mean"], expected_mean, atol=1e-5)
    assert not np.array_equal(out_a, out_b)  # a new dropout mask from the advanced key


def test_unsupported_dynamic_shape_spec_is_refused_clearly():
    with pytest.raises(TypeError, match=r"dynamic_shapes\['input'\]\[0\] is 'batch'; expected a torch.export.Dim"):
        t2j.export(_model(), torch.randn(2, 16), dynamic_shapes={"input": {0: "batch"}})
    with pytest.raises(ValueError, match=r"names \['x'\], which are not tensor arguments of Sequential.forward"):
        t2j.export(_model(), torch.randn(2, 16), dynamic_shapes={"x": {0: Dim("batch")}})


def _call(exported, state, *arrays, key=0):
    return exported.call(state, jax.random.key(key), *(jnp.asarray(a) for a in arrays))


def test_dynamic_batch_eval_matches_torch_at_several_sizes():
    model = _model().eval()
    exported = t2j.export(model, torch.randn(6, 16), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
    assert not isinstance(exported.in_avals[-1].shape[0], int)  # a symbolic dimension
    _, state = t2j.functionalize(model)
    for n in (2, 9, 64):
        x = torch.randn(n, 16)
        out, _, _ = _call(exported, state, x.numpy())
        np.testing.assert_allclose(out, model(x).detach().numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="batch|s[0-9]+"):  # outside the Dim's range
        _call(exported, state, np.zeros((65, 16), np.float32))


class _Scaled(nn.Module):
    def forward(self, x):
        return x / 4.0 + x[..., :1] / torch.tensor(3.0)


def test_division_by_a_number_with_a_dynamic_dimension():
    # the correctly rounded division picked its iota's axis with np.argmax over the shape, which
    # compared the symbolic dimension (InconclusiveDimensionOperation)
    for example, dims in [(torch.randn(6, 5), ({0: Dim("batch", min=2, max=64)},)),
                          (torch.randn(6, 1), ({0: Dim("batch", min=2, max=64)},))]:
        exported = t2j.export(_Scaled(), example, dynamic_shapes=dims)
        for n in (2, 11):
            x = torch.randn(n, example.shape[1])
            out, _, _ = _call(exported, {"params": {}, "buffers": {}}, x.numpy())
            np.testing.assert_allclose(out, _Scaled()(x).numpy(), rtol=1e-6)


def test_windows_over_a_dynamic_dimension_are_refused_by_name():
    class Patches(nn.Module):
        def forward(self, x):
            return nn.functional.unfold(x, kernel_size=2)

    dims = ({2: Dim("h", min=3, max=64), 3: Dim("w", min=3, max=64)},)
    with pytest.raises(t2j.OpError, match=r"aten.im2col.default needs concrete sizes .* symbolic"):
        t2j.export(Patches(), torch.randn(2, 3, 6, 6), dynamic_shapes=dims)


def test_dynamic_batch_train_mode_updates_batchnorm_statistics():
    model = _model().train()
    # batch statistics need two samples, as in torch: min=2 makes that provable for the symbolic batch
    exported = t2j.export(model, torch.randn(6, 16), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
    _, state = t2j.functionalize(model)
    for n in (4, 11):
        x = torch.randn(n, 16)
        out, buffers, _ = _call(exported, state, x.numpy())
        assert out.shape == (n, 4)
        h = model[0](x).detach()
        np.testing.assert_allclose(buffers["1.running_mean"], 0.1 * h.mean(0).numpy(), atol=1e-5)
        np.testing.assert_allclose(buffers["1.running_var"], 0.9 + 0.1 * h.var(0).numpy(), atol=1e-5)
        assert int(buffers["1.num_batches_tracked"]) == 1


def test_dynamic_export_round_trips_through_bytes():
    model = _model().eval()
    exported = t2j.export(model, torch.randn(6, 16), dynamic_shapes=({0: Dim("batch", max=64)},))
    restored = jax.export.deserialize(exported.serialize())
    _, state = t2j.functionalize(model)
    x = torch.randn(13, 16)
    out, _, _ = _call(restored, state, x.numpy())
    np.testing.assert_allclose(out, model(x).detach().numpy(), atol=1e-5)


def test_dynamic_export_of_a_module_on_the_jax_device():
    model = _model().eval()
    expected_model = copy.deepcopy(model)
    model.to("jax")
    exported = t2j.export(model, torch.randn(6, 16).to("jax"), dynamic_shapes=({0: Dim("batch")},))
    _, state = t2j.functionalize(model)
    x = torch.randn(3, 16)
    out, _, _ = _call(exported, state, x.numpy())
    np.testing.assert_allclose(out, expected_model(x).detach().numpy(), atol=1e-5)


def test_export_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)).eval()
    ids = torch.randint(0, 64, (2, 8))
    exported = t2j.export(model, ids, use_cache=False)
    _, state = t2j.functionalize(model)
    out, _, _ = exported.call(state, jax.random.key(0), jnp.asarray(ids.numpy()))
    np.testing.assert_allclose(out["logits"], model(ids, use_cache=False).logits.detach().numpy(), atol=1e-4)


def _hf(name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
        return transformers.GPT2LMHeadModel(config).eval(), {"use_cache": False}
    if name == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                          max_position_embeddings=32)
        return transformers.LlamaForCausalLM(config).eval(), {"use_cache": False}
    config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=64, max_position_embeddings=32)
    return transformers.BertForMaskedLM(config).eval(), {}


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow)])
def test_export_hf_with_dynamic_batch_and_sequence(name):
    model, kwargs = _hf(name)
    dims = {"input_ids": {0: Dim("batch", max=16), 1: Dim("seq", max=32)}}
    exported = t2j.export(model, torch.randint(0, 64, (2, 8)), dynamic_shapes=dims, **kwargs)
    # the model output is a plain dict in the program: it loads without transformers' classes
    exported = jax.export.deserialize(exported.serialize())
    _, state = t2j.functionalize(model)
    for batch, seq in ((3, 5), (1, 17)):
        ids = torch.randint(0, 64, (batch, seq))
        out, _, _ = _call(exported, state, ids.numpy())
        np.testing.assert_allclose(out["logits"], model(ids, **kwargs).logits.detach().numpy(), atol=1e-4)


def test_dynamic_sequence_length_with_causal_attention():
    class Causal(torch.nn.Module):
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    model = Causal()
    exported = t2j.export(model, torch.randn(1, 2, 5, 8), dynamic_shapes=({2: Dim("t", min=2, max=16)},))
    _, state = t2j.functionalize(model)
    for t in (2, 7, 16):
        q = torch.randn(1, 2, t, 8)
        out = _call(exported, state, q.numpy())[0]
        np.testing.assert_allclose(out, model(q).numpy(), atol=1e-5)


def test_symbolic_dims_through_functionalize_point_to_t2j_export():
    fn, state = t2j.functionalize(nn.Linear(4, 2).to("jax"))
    (b,) = jax.export.symbolic_shape("b")
    with pytest.raises(TypeError, match=r"symbolic dimensions.*t2j\.export"):
        jax.export.export(jax.jit(fn))(state, jax.ShapeDtypeStruct((b, 4), jnp.float32))
