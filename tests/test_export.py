"""t2j.export: StableHLO that runs without torch, with state, buffers and RNG explicit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn

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


def test_dynamic_shapes_are_refused_clearly():
    with pytest.raises(NotImplementedError, match="symbolic dimensions"):
        t2j.export(_model(), torch.randn(2, 16), dynamic_shapes={"input": {0: "batch"}})


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
