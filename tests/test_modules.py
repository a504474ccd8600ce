"""t2j.modules: torch modules as flax nnx / equinox modules and back, against torch CPU
and against pure JAX references."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from flax import nnx

import torch2jax as t2j

ATOL = 1e-5


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _conv_bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _loss_torch(model, x):
    return model(torch.from_numpy(x)).pow(2).mean()


def _torch_grads(model, x):
    model.zero_grad()
    _loss_torch(model, x).backward()
    return {n: p.grad.numpy() for n, p in model.named_parameters()}


def _assert_tree_close(actual: dict, expected: dict, atol=ATOL):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(np.asarray(actual[name]), expected[name], atol=atol, rtol=1e-4, err_msg=name)


def _torch_sgd_steps(model, x, steps, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        _loss_torch(model, x).backward()
        opt.step()
    return {n: p.detach().numpy() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------
# torch -> flax nnx
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("make, shape", [(_mlp, (5, 4)), (_conv_bn, (3, 2, 6, 6))], ids=["mlp", "conv_bn"])
def test_to_nnx_output_and_grads_match_torch(make, shape):
    model = t2j.modules.to_nnx(make())
    x = _x(*shape)
    torch_model = make()
    expected_out = torch_model(torch.from_numpy(x)).detach().numpy()
    expected = _torch_grads(make(), x)
    out = nnx.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(out, expected_out, atol=ATOL)
    grads = nnx.jit(nnx.grad(lambda m, x: (m(x) ** 2).mean()))(model, x)
    _assert_tree_close({n: v[...] for n, v in grads["params"].items()}, expected)


def test_to_nnx_batchnorm_stats_and_eval_mode_match_torch():
    torch_model = _conv_bn()
    model = t2j.modules.to_nnx(_conv_bn())
    x = _x(3, 2, 6, 6)
    torch_model(torch.from_numpy(x))
    nnx.jit(lambda m, x: m(x))(model, x)
    for name in ("1.running_mean", "1.running_var"):
        np.testing.assert_allclose(model.buffers[name][...], torch_model.get_buffer(name).numpy(), atol=ATOL)
    assert int(model.buffers["1.num_batches_tracked"][...]) == 1
    torch_model.eval()
    model.eval()
    x2 = _x(2, 2, 6, 6, seed=1)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x2),
                               torch_model(torch.from_numpy(x2)).detach().numpy(), atol=ATOL)
    assert model.torch_module.training, "the torch module's own mode is left alone"


@pytest.mark.parametrize("make, shape", [(_mlp, (5, 4)), (_conv_bn, (3, 2, 6, 6))], ids=["mlp", "conv_bn"])
def test_to_nnx_optax_sgd_steps_match_torch_sgd(make, shape):
    x = _x(*shape)
    expected = _torch_sgd_steps(make(), x, steps=3, lr=0.1)
    model = t2j.modules.to_nnx(make())
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, x)) for _ in range(3)]
    assert losses[-1] < losses[0]
    _assert_tree_close({n: v[...] for n, v in model.params.items()}, expected)
    trained = model.to_torch()
    _assert_tree_close({n: p.detach().numpy() for n, p in trained.named_parameters()}, expected)


def test_to_nnx_dropout_draws_from_rngs_under_jit():
    torch.manual_seed(0)
    model = t2j.modules.to_nnx(nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5)), rngs=nnx.Rngs(0))
    x = _x(2, 4)
    run = nnx.jit(lambda m, x: m(x))
    a, b = np.asarray(run(model, x)), np.asarray(run(model, x))
    assert (a == 0).any() and not np.array_equal(a == 0, b == 0), "a fresh mask per call"
    model.eval()
    np.testing.assert_array_equal(run(model, x), run(model, x))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def _gpt2_ids():
    return np.random.default_rng(0).integers(0, 64, (2, 8))


def test_to_nnx_gpt2_logits_and_grads_match_torch():
    ids = _gpt2_ids()
    torch_model = _gpt2()
    logits = torch_model(torch.from_numpy(ids)).logits
    loss = logits.pow(2).mean()
    loss.backward()
    expected = {n: p.grad.numpy() for n, p in torch_model.named_parameters()}
    model = t2j.modules.to_nnx(_gpt2())

    def loss_fn(m, ids):
        out = m(ids).logits
        return (out ** 2).mean(), out

    (value, out), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model, jnp.asarray(ids))
    np.testing.assert_allclose(out, logits.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(value, loss.item(), rtol=1e-5)
    _assert_tree_close({n: v[...] for n, v in grads["params"].items()}, expected, atol=1e-4)


# ---------------------------------------------------------------------------
# torch -> equinox
# ---------------------------------------------------------------------------


def test_to_equinox_mlp_grads_and_optax_sgd_match_torch():
    x = _x(5, 4)
    expected_grads = _torch_grads(_mlp(), x)
    expected = _torch_sgd_steps(_mlp(), x, steps=3, lr=0.1)
    model = t2j.modules.to_equinox(_mlp())
    loss_fn = lambda m, x: (m(x) ** 2).mean()  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(loss_fn))(model, x)
    _assert_tree_close(grads.params, expected_grads)
    optim = optax.sgd(0.1)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    for _ in range(3):
        model, opt_state, _ = step(model, opt_state, x)
    _assert_tree_close(model.params, expected)


def test_to_equinox_batchnorm_state_and_inference_mode_match_torch():
    x = _x(3, 2, 6, 6)
    expected_grads = _torch_grads(_conv_bn(), x)
    torch_model = _conv_bn()
    expected_out = torch_model(torch.from_numpy(x)).detach().numpy()
    model, state = eqx.nn.make_with_state(t2j.modules.to_equinox)(_conv_bn())
    with pytest.raises(TypeError, match="to_equinox.*make_with_state"):
        model(x)

    def loss_fn(m, s, x):
        out, s = m(x, state=s)
        return (out ** 2).mean(), (out, s)

    grads, (out, state) = eqx.filter_jit(eqx.filter_grad(loss_fn, has_aux=True))(model, state, x)
    np.testing.assert_allclose(out, expected_out, atol=ATOL)
    _assert_tree_close(grads.params, expected_grads)
    buffers = state.get(model.buffers)
    for name in ("1.running_mean", "1.running_var"):
        np.testing.assert_allclose(buffers[name], torch_model.get_buffer(name).numpy(), atol=ATOL)
    torch_model.eval()
    x2 = _x(2, 2, 6, 6, seed=1)
    out2, _ = eqx.nn.inference_mode(model)(x2, state=state)
    np.testing.assert_allclose(out2, torch_model(torch.from_numpy(x2)).detach().numpy(), atol=ATOL)


def test_to_equinox_gpt2_grads_match_torch():
    ids = _gpt2_ids()
    torch_model = _gpt2()
    torch_model(torch.from_numpy(ids)).logits.pow(2).mean().backward()
    expected = {n: p.grad.numpy() for n, p in torch_model.named_parameters()}
    model = t2j.modules.to_equinox(_gpt2())
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, ids: (m(ids).logits ** 2).mean()))(model, jnp.asarray(ids))
    _assert_tree_close(grads.params, expected, atol=1e-4)


def test_to_nnx_and_to_equinox_refuse_non_modules():
    with pytest.raises(TypeError, match=r"to_nnx: expected a torch.nn.Module, got function"):
        t2j.modules.to_nnx(lambda x: x)
    with pytest.raises(TypeError, match=r"to_equinox: expected a torch.nn.Module, got Linear"):
        t2j.modules.to_equinox(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


# ---------------------------------------------------------------------------
# JAX -> torch
# ---------------------------------------------------------------------------


class _NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(8, 16, rngs=rngs)
        self.fc2 = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class _Mixed(nn.Module):
    """torch embedding -> nnx MLP -> equinox MLP -> torch head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.block = t2j.modules.from_nnx(_NnxMLP(nnx.Rngs(0)))
        self.eqx_mlp = t2j.modules.from_equinox(eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(1)), vmap=True)
        self.head = nn.Linear(8, 10)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.block(h)
        h = h + self.eqx_mlp(h)
        return self.head(h)


def _mixed_reference(state, static, ids, y):
    """The `_Mixed` model written directly in JAX (same parameters, as a dict)."""
    nnx_mlp = nnx.merge(static["graphdef"], state["nnx"])
    eqx_mlp = eqx.combine(state["eqx"], static["eqx_static"])
    h = state["emb"][ids]
    h = h + nnx_mlp(h)
    h = h + jax.vmap(eqx_mlp)(h)
    logits = h @ state["head_w"].T + state["head_b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _reference_state(model: _Mixed):
    """``(params, static)`` of the reference: the model's current values, read through `to_jax`."""
    graphdef, nnx_params = nnx.split(model.block.to_jax())
    eqx_params, eqx_static = eqx.partition(model.eqx_mlp.to_jax(), eqx.is_inexact_array)
    params = {"nnx": nnx_params, "eqx": eqx_params, "emb": model.emb.weight.jax(), "head_w": model.head.weight.jax(),
              "head_b": model.head.bias.jax()}
    return params, {"graphdef": graphdef, "eqx_static": eqx_static}


def _ids_and_labels():
    rng = np.random.default_rng(0)
    return rng.integers(0, 10, (6,)), rng.integers(0, 10, (6,))


def test_from_nnx_and_from_equinox_parameters_share_the_arrays():
    block = _NnxMLP(nnx.Rngs(0))
    wrapped = t2j.modules.from_nnx(block)
    assert [n for n, _ in wrapped.named_parameters()] == [
        "jax_params.fc1.bias", "jax_params.fc1.kernel", "jax_params.fc2.bias", "jax_params.fc2.kernel"]
    kernel = wrapped.get_parameter("jax_params.fc1.kernel")
    assert isinstance(kernel, t2j.Tensor) and isinstance(kernel, nn.Parameter) and kernel.requires_grad
    assert kernel.jax() is block.fc1.kernel[...]
    mlp = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(1))
    weight = t2j.modules.from_equinox(mlp).get_parameter("jax_params.layers.0.weight")
    assert weight.jax() is mlp.layers[0].weight


def test_from_nnx_and_from_equinox_grads_match_jax_grad():
    ids, y = _ids_and_labels()
    model = _Mixed().to("jax")
    params, static = _reference_state(model)
    loss = F.cross_entropy(model(torch.from_numpy(ids).to("jax")), torch.from_numpy(y).to("jax"))
    loss.backward()
    reference = jax.jit(jax.value_and_grad(lambda p, ids, y: _mixed_reference(p, static, ids, y)))
    value, grads = reference(params, jnp.asarray(ids), jnp.asarray(y))
    np.testing.assert_allclose(loss.item(), value, rtol=1e-6)
    np.testing.assert_allclose(model.emb.weight.grad.jax(), grads["emb"], atol=1e-6)
    np.testing.assert_allclose(model.head.weight.grad.jax(), grads["head_w"], atol=1e-6)
    np.testing.assert_allclose(model.block.get_parameter("jax_params.fc1.kernel").grad.jax(),
                               grads["nnx"]["fc1"]["kernel"][...], atol=1e-6)
    np.testing.assert_allclose(model.eqx_mlp.get_parameter("jax_params.layers.0.weight").grad.jax(),
                               grads["eqx"].layers[0].weight, atol=1e-6)


def test_from_nnx_linear_matches_torch_linear_on_cpu():
    layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    wrapped = t2j.modules.from_nnx(layer)
    torch_layer = nn.Linear(4, 3)
    with torch.no_grad():
        torch_layer.weight.copy_(torch.from_numpy(np.asarray(layer.kernel[...]).T.copy()))
        torch_layer.bias.copy_(torch.from_numpy(np.array(layer.bias[...])))
    x = _x(5, 4)
    torch_layer(torch.from_numpy(x)).pow(2).sum().backward()
    out = wrapped(torch.from_numpy(x).to("jax"))
    out.pow(2).sum().backward()
    np.testing.assert_allclose(out.detach().cpu().numpy(), torch_layer(torch.from_numpy(x)).detach().numpy(),
                               atol=ATOL)
    np.testing.assert_allclose(wrapped.jax_params.kernel.grad.cpu().numpy(), torch_layer.weight.grad.numpy().T,
                               atol=ATOL)
    np.testing.assert_allclose(wrapped.jax_params.bias.grad.cpu().numpy(), torch_layer.bias.grad.numpy(), atol=ATOL)


def _adamw_reference(model: _Mixed, ids, y, steps, lr):
    state, static = _reference_state(model)
    optim = optax.adamw(lr, weight_decay=0.01)
    opt_state = optim.init(state)

    @jax.jit
    def step(state, opt_state):
        loss, grads = jax.value_and_grad(lambda s: _mixed_reference(s, static, ids, y))(state)
        updates, opt_state = optim.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        state, opt_state, loss = step(state, opt_state)
        losses.append(float(loss))
    return state, losses


def test_mixed_model_adamw_under_t2j_jit_matches_optax_reference():
    ids, y = _ids_and_labels()
    model = _Mixed().to("jax")
    expected, expected_losses = _adamw_reference(_Mixed().to("jax"), jnp.asarray(ids), jnp.asarray(y), 4, 1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

    @t2j.jit
    def step(ids, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(ids), y)
        loss.backward()
        opt.step()
        return loss

    ids_t, y_t = torch.from_numpy(ids).to("jax"), torch.from_numpy(y).to("jax")
    losses = [step(ids_t, y_t).item() for _ in range(4)]
    assert step.stats["traces"] == 2, t2j.explain_recompiles()  # the first step creates .grad and AdamW state
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    trained, _ = _reference_state(model)
    np.testing.assert_allclose(trained["emb"], expected["emb"], atol=1e-5)
    np.testing.assert_allclose(trained["nnx"]["fc2"]["kernel"][...], expected["nnx"]["fc2"]["kernel"][...], atol=1e-5)
    np.testing.assert_allclose(trained["eqx"].layers[1].bias, expected["eqx"].layers[1].bias, atol=1e-5)


class _NnxStateful(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.drop(self.fc(x)))


def test_from_nnx_state_is_carried_and_visible_after_to_jax():
    block = _NnxStateful(nnx.Rngs(0))
    wrapped = t2j.modules.from_nnx(block).to("jax")
    x = torch.from_numpy(_x(8, 4)).to("jax")
    run = t2j.jit(lambda x: wrapped(x))
    a, b = run(x).detach().cpu().numpy(), run(x).detach().cpu().numpy()
    assert not np.array_equal(a, b), "the dropout key advances every call (train-mode BatchNorm: same params)"
    assert int(wrapped.get_buffer("jax_state.drop.rngs.count").item()) == 2
    mean = wrapped.get_buffer("jax_state.bn.mean").jax()
    assert float(jnp.abs(mean).sum()) > 0
    assert wrapped.to_jax() is block
    np.testing.assert_array_equal(block.bn.mean[...], mean)
    assert int(block.drop.rngs.count[...]) == 2
    wrapped.eval()
    block.eval()
    np.testing.assert_allclose(wrapped(x).detach().jax(), block(x.jax()), atol=1e-6)


def test_from_nnx_eager_torch_optim_step_reaches_the_nnx_module():
    block = _NnxMLP(nnx.Rngs(0))
    wrapped = t2j.modules.from_nnx(block)
    before = np.asarray(block.fc1.kernel[...])
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    wrapped(torch.from_numpy(_x(3, 8)).to("jax")).pow(2).sum().backward()
    grad = wrapped.jax_params.fc1.kernel.grad.jax()
    opt.step()
    np.testing.assert_array_equal(block.fc1.kernel[...], before)  # JAX arrays are immutable: until to_jax()
    np.testing.assert_allclose(wrapped.to_jax().fc1.kernel[...], before - 0.5 * np.asarray(grad), atol=1e-6)


def test_from_jax_modules_refuse_bad_input():
    with pytest.raises(TypeError, match=r"from_nnx: expected a flax.nnx.Module, got Linear"):
        t2j.modules.from_nnx(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"from_equinox: expected an equinox.Module, got Linear"):
        t2j.modules.from_equinox(nn.Linear(2, 2))
    mlp = t2j.modules.from_equinox(eqx.nn.MLP(8, 2, 4, 1, key=jax.random.key(0)), vmap=True)
    with pytest.raises(TypeError, match=r"from_equinox: calling the wrapped MLP on inputs \(torch.float32\[5, 3\]\)"):
        mlp(torch.zeros(5, 3, device="jax"))
    block = t2j.modules.from_nnx(_NnxMLP(nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"from_nnx: calling the wrapped _NnxMLP on inputs"):
        block(torch.zeros(5, 3, device="jax"))


@pytest.mark.slow
def test_mixed_flax_torch_example_trains():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import mixed_flax_torch

    losses = mixed_flax_torch.main(steps=60, batch=8)
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])


def test_from_equinox_stateful_batchnorm_matches_jax_reference():
    eqx_model, eqx_state = eqx.nn.make_with_state(eqx.nn.Sequential)(
        [eqx.nn.Linear(3, 4, key=jax.random.key(0)), eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")])
    wrapped = t2j.modules.from_equinox(eqx_model, eqx_state, vmap=True)
    assert [n for n, _ in wrapped.named_buffers()] == ["jax_state.0", "jax_state.1.0", "jax_state.1.1"]
    x = _x(6, 3)

    def reference(model, state, x):
        out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
        return (out ** 2).mean(), state

    (value, new_state), grads = eqx.filter_value_and_grad(reference, has_aux=True)(eqx_model, eqx_state, x)
    step = t2j.jit(lambda x: wrapped(x).pow(2).mean())
    xt = torch.from_numpy(x).to("jax").requires_grad_()
    loss = wrapped(xt).pow(2).mean()
    loss.backward()
    np.testing.assert_allclose(loss.item(), value, rtol=1e-6)
    np.testing.assert_allclose(wrapped.get_parameter("jax_params.layers.0.weight").grad.jax(),
                               grads.layers[0].weight, atol=1e-6)
    _, state = wrapped.to_jax()
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    x2 = _x(6, 3, seed=1)
    step(torch.from_numpy(x2).to("jax"))  # under t2j.jit too: the state buffers are carried out of the program
    _, state = wrapped.to_jax()
    _, second_state = reference(eqx_model, new_state, x2)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(second_state)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    wrapped.eval()
    expected, _ = jax.vmap(eqx.nn.inference_mode(eqx_model), axis_name="batch", in_axes=(0, None),
                           out_axes=(0, None))(x, new_state)
    after_one = t2j.modules.from_equinox(eqx_model, new_state, vmap=True).eval()
    np.testing.assert_allclose(after_one(torch.from_numpy(x).to("jax")).detach().jax(), expected, atol=1e-5)
    with pytest.raises(TypeError, match="from_equinox: state must be an eqx.nn.State"):
        t2j.modules.from_equinox(eqx_model, {"a": 1})


def test_round_trip_torch_to_nnx_to_torch_matches_torch():
    x = _x(5, 4)
    torch_model = _mlp()
    expected_out = torch_model(torch.from_numpy(x))
    expected = _torch_grads(_mlp(), x)
    wrapped = t2j.modules.from_nnx(t2j.modules.to_nnx(_mlp()))
    assert [n for n, _ in wrapped.named_parameters()] == [
        "jax_params.params.0_bias", "jax_params.params.0_weight", "jax_params.params.2_bias",
        "jax_params.params.2_weight"]
    out = wrapped(torch.from_numpy(x).to("jax"))
    out.pow(2).mean().backward()
    np.testing.assert_allclose(out.detach().cpu().numpy(), expected_out.detach().numpy(), atol=ATOL)
    grads = {n.removeprefix("jax_params.params.").replace("_", "."): p.grad.cpu().numpy()
             for n, p in wrapped.named_parameters()}
    _assert_tree_close(grads, expected)


def test_functionalize_and_functional_call_of_a_model_holding_a_from_nnx_layer():
    jax_layer = t2j.modules.from_nnx(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    model = nn.Sequential(nn.Linear(3, 4), jax_layer).to("jax")
    x = torch.randn(2, 3)
    want = model(x.to("jax")).detach().cpu().numpy()
    fn, state = t2j.functionalize(model)
    np.testing.assert_allclose(np.asarray(fn(state, jnp.asarray(x.numpy()))), want, rtol=1e-5)
    params = {k: v * 2 for k, v in model.named_parameters()}
    doubled = torch.func.functional_call(model, params, (x.to("jax"),))
    w0, b0, k1, b1 = (params[n].detach().cpu() for n in ("0.weight", "0.bias", "1.jax_params.kernel",
                                                         "1.jax_params.bias"))
    np.testing.assert_allclose(doubled.detach().cpu().numpy(), ((x @ w0.T + b0) @ k1 + b1).numpy(), rtol=1e-5)


def test_to_equinox_inference_mode_without_buffers_turns_dropout_off():
    torch_model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).to("jax")
    x = jnp.ones((4, 8))
    model = eqx.nn.inference_mode(t2j.modules.to_equinox(torch_model))
    np.testing.assert_array_equal(model(x), model(x))
    np.testing.assert_array_equal(eqx.filter_jit(lambda m, x: m(x))(model, x), model(x))
    training = eqx.nn.inference_mode(model, value=False)
    assert (training(x, key=jax.random.key(0)) == 0).any()


class _DropoutNnx(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


def test_from_nnx_with_state_runs_under_torch_func_in_eval_mode():
    layer = t2j.modules.from_nnx(_DropoutNnx()).eval()
    x = torch.randn(3, 4, device="jax")
    g = torch.func.grad(lambda v: layer(v).sum())(x)
    x_ = x.clone().requires_grad_()
    layer(x_).sum().backward()
    np.testing.assert_allclose(g.detach().cpu().numpy(), x_.grad.cpu().numpy(), rtol=1e-6)
    np.testing.assert_allclose(torch.func.vmap(layer)(x[:, None]).squeeze(1).detach().cpu().numpy(),
                               layer(x).detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
    # in training mode the statistics still update
    layer.train()
    before = layer.jax_state.bn.mean.clone()
    layer(x)
    assert not torch.equal(before, layer.jax_state.bn.mean)
