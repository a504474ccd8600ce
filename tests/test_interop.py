"""jax_view / torch_view, call_jax / call_torch and functionalize, against torch CPU."""

from __future__ import annotations

import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn

import torch2jax as t2j


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _x(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_views_of_values():
    t = torch.arange(3.0, device="jax")
    tree = t2j.jax_view({"a": t, "b": [t, 1]})
    assert isinstance(tree["a"], jax.Array) and tree["b"][1] == 1
    back = t2j.torch_view(tree)
    assert isinstance(back["a"], t2j.Tensor) and back["a"].tolist() == [0.0, 1.0, 2.0]


def test_functionalize_grad_matches_torch():
    model = _mlp()
    fn, state = t2j.functionalize(model)
    x = _x(5, 4)
    grads = jax.jit(jax.grad(lambda s, x: (fn(s, x) ** 2).sum()))(state, x)
    model(torch.from_numpy(x)).pow(2).sum().backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(grads["params"][name], p.grad.numpy(), atol=1e-5, rtol=1e-5)


def test_functionalize_hf_decoding_with_its_kv_cache_under_jax_jit():
    # use_cache=True returns a DynamicCache: an object holding tensors, which crosses jax.jit as a pytree
    import copy

    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=True)
        want = model(input_ids=torch.tensor([[3]]), past_key_values=first.past_key_values, use_cache=True).logits
    fn, state = t2j.functionalize(copy.deepcopy(model).to("jax"))
    prefill = jax.jit(lambda s, i: fn(s, input_ids=i, use_cache=True))
    decode = jax.jit(lambda s, i, cache: fn(s, input_ids=i, past_key_values=cache, use_cache=True))
    cache = prefill(state, jnp.asarray(ids.numpy()))["past_key_values"]
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(cache))
    got = decode(state, jnp.asarray([[3]]), cache)
    np.testing.assert_allclose(np.asarray(got["logits"]), want.numpy(), rtol=1e-5, atol=1e-5)
    assert [leaf.shape[2] for leaf in jax.tree.leaves(got["past_key_values"])] == [9] * 4  # keys, values per layer


def test_functionalize_vmap_and_scan():
    fn, state = t2j.functionalize(_mlp())
    x = _x(6, 4)
    batched = jax.vmap(fn, in_axes=(None, 0))(state, x)
    np.testing.assert_allclose(batched, fn(state, x), atol=1e-6)

    def body(carry, xi):
        return carry + fn(state, xi[None]).sum(), None

    total, _ = jax.lax.scan(body, jnp.float32(0), x)
    np.testing.assert_allclose(total, fn(state, x).sum(), rtol=1e-5)


def test_functionalize_tied_weights_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    fn, state = t2j.functionalize(Tied())
    assert list(state["params"]) == ["emb.weight"]
    ids = jnp.array([1, 2, 3])
    g = jax.grad(lambda s: fn(s, ids).sum())(state)["params"]["emb.weight"]
    model = Tied()
    model.load_state_dict({"emb.weight": torch.from_numpy(np.asarray(state["params"]["emb.weight"])),
                           "head.weight": torch.from_numpy(np.asarray(state["params"]["emb.weight"]))})
    model(torch.tensor([1, 2, 3])).sum().backward()
    np.testing.assert_allclose(g, model.emb.weight.grad.numpy(), atol=1e-5)


def test_functionalize_batchnorm_state_and_eval_mode():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    fn, state = t2j.functionalize(bn)
    x = _x(8, 4)
    out, new_state = jax.jit(fn.apply)(state, x)
    expected = bn(torch.from_numpy(x))
    np.testing.assert_allclose(out, expected.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(new_state["buffers"]["running_var"], bn.running_var.numpy(), atol=1e-6)
    assert int(new_state["buffers"]["num_batches_tracked"]) == 1
    bn.eval()
    np.testing.assert_allclose(fn(new_state, x), bn(torch.from_numpy(x)).detach().numpy(), atol=1e-5)


def test_functionalize_dropout_needs_a_key_under_jit():
    fn, state = t2j.functionalize(nn.Dropout(0.5))
    with pytest.raises(RuntimeError, match="no RNG key"):
        jax.jit(fn)(state, jnp.ones(16))
    a = jax.jit(fn)(state, jnp.ones(16), rng=jax.random.key(0))
    b = jax.jit(fn)(state, jnp.ones(16), rng=jax.random.key(1))
    c = jax.jit(fn)(state, jnp.ones(16), rng=jax.random.key(0))
    assert not np.array_equal(a, b) and np.array_equal(a, c)
    assert set(np.unique(np.asarray(a))) <= {0.0, 2.0}


def test_call_jax_gradients_reach_torch():
    w = torch.randn(5, device="jax", requires_grad=True)
    loss = t2j.call_jax(lambda v, k: jnp.sum(jnp.sin(v) ** 2) * k, w, 3.0)
    loss.backward()
    wc = w.detach().cpu().requires_grad_(True)
    (torch.sin(wc).pow(2).sum() * 3.0).backward()
    torch.testing.assert_close(w.grad.cpu(), wc.grad)


def test_call_jax_inputs_no_output_reaches_get_no_gradient():
    # as torch's graph with no path: None, not zeros (AdamW then leaves the parameter alone)
    w, unused, other = (torch.randn(3, device="jax", requires_grad=True) for _ in range(3))
    loss, aux = t2j.call_jax(lambda a, b, c: (jnp.sum(jnp.sin(a)), jnp.sum(c * 2)), w, unused, other)
    loss.backward(retain_graph=True)  # (one node of torch's graph for both outputs, as a torch op's)
    assert w.grad is not None and unused.grad is None and other.grad is None
    aux.backward()
    torch.testing.assert_close(other.grad.cpu(), torch.full((3,), 2.0))
    assert unused.grad is None
    opt = torch.optim.AdamW([w, unused, other], lr=0.1, weight_decay=0.5)
    before = unused.detach().clone()
    opt.step()
    torch.testing.assert_close(unused.detach(), before)


def test_call_jax_second_backward_without_retain_graph_raises_as_torch():
    x = torch.randn(3, device="jax", requires_grad=True)
    y = t2j.call_jax(jnp.sin, x)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * x.detach().cpu().cos())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
    # the node's inputs are not saved: JAX holds their values, so writing to one later is no error
    z = t2j.call_jax(jnp.sin, x)
    with torch.no_grad():
        x.add_(1)
    z.sum().backward()


def test_call_jax_on_cpu_tensors_gives_cpu_tensors():
    x_cpu = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y, n = t2j.call_jax(lambda v: (jnp.sum(jnp.sin(v) * v), v.shape[0]), x_cpu)
    assert y.device.type == "cpu" and y.dtype == torch.float32 and n == 4  # (JAX's 32-bit default)
    y.backward()
    assert x_cpu.grad.device.type == "cpu" and x_cpu.grad.dtype == torch.float64
    expected = (x_cpu.detach().cos() * x_cpu.detach() + x_cpu.detach().sin())
    torch.testing.assert_close(x_cpu.grad, expected, rtol=1e-5, atol=1e-6)
    mixed = t2j.call_jax(lambda a, b: a + b, torch.ones(2), torch.ones(2, device="jax"))
    assert mixed.device.type == "jax"


def test_call_jax_complex_gradients_in_torch_convention():
    # torch's gradient of a complex value is the conjugate of JAX's cotangent
    z_cpu = torch.tensor([1 + 2j, 3 - 1j], requires_grad=True)
    z = z_cpu.detach().to("jax").requires_grad_()
    (z_cpu.abs() ** 2 * torch.tensor([1.0, 2.0]) + z_cpu.real).sum().backward()
    t2j.call_jax(lambda v: (jnp.abs(v) ** 2 * jnp.array([1.0, 2.0]) + v.real).sum(), z).backward()
    torch.testing.assert_close(z.grad.cpu(), z_cpu.grad)


def test_call_jax_second_derivative_and_integer_outputs():
    x_cpu = torch.randn(4, requires_grad=True)
    x = x_cpu.detach().to("jax").requires_grad_()
    (g,) = torch.autograd.grad((x_cpu.sin() * x_cpu).sum(), x_cpu, create_graph=True)
    (g ** 2).sum().backward()
    y, idx = t2j.call_jax(lambda v: ((jnp.sin(v) * v).sum(), jnp.argmax(v)), x)
    assert idx.dtype == torch.int32  # JAX's own index type (no jax_enable_x64)
    (g,) = torch.autograd.grad(y, x, create_graph=True)  # the integer output gets a float0 cotangent
    (g ** 2).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad)


def test_call_jax_runs_under_jax_configuration():
    # JAX code sees what it would in a JAX program: 32-bit defaults, the same random numbers
    key = jax.random.key(0)
    assert t2j.call_jax(lambda v: v + jnp.zeros(3), torch.ones(3, device="jax")).dtype == torch.float32
    drawn = t2j.call_jax(lambda v, k: v * jax.random.normal(k, (2,)), torch.ones(2, device="jax"), key)
    np.testing.assert_array_equal(drawn.cpu().numpy(), np.asarray(jax.random.normal(key, (2,))))
    labels = torch.tensor([1, 0], device="jax")  # int64 in torch
    seen = t2j.call_jax(lambda i: i, labels)
    assert seen.dtype == torch.int32 and seen.tolist() == [1, 0]
    # gradients come back in the tensors' own dtype and device
    w64 = torch.ones(3, dtype=torch.float64, device="jax", requires_grad=True)
    w_cpu = torch.ones(3, requires_grad=True)
    t2j.call_jax(lambda a, b: (a * b).sum() ** 2, w64, w_cpu).backward()
    assert w64.grad.dtype == torch.float64 and w_cpu.grad.device.type == "cpu"
    assert w64.grad.tolist() == w_cpu.grad.tolist() == [6.0] * 3
    jax.config.update("jax_enable_x64", True)
    try:
        assert t2j.call_jax(lambda v: v + jnp.zeros(3), torch.ones(3, device="jax")).dtype == torch.float64
        assert t2j.call_jax(lambda i: i, labels).dtype == torch.int64
    finally:
        jax.config.update("jax_enable_x64", False)


def test_torch_func_transforms_through_call_jax():
    def f(v):
        return t2j.call_jax(lambda a: (a ** 3).sum(), v)

    x = torch.arange(6.0, device="jax").reshape(2, 3)
    torch.testing.assert_close(torch.func.grad(f)(x[0]).cpu(), 3 * x[0].cpu() ** 2)
    torch.testing.assert_close(torch.func.vmap(f)(x).cpu(), (x.cpu() ** 3).sum(1))
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(f))(x).cpu(), 3 * x.cpu() ** 2)
    jac = torch.func.jacrev(lambda v: t2j.call_jax(lambda a: a ** 2, v))(x[0])
    torch.testing.assert_close(jac.cpu(), torch.diag(2 * x[0].cpu()))
    # forward mode: jax.jvp
    jac = torch.func.jacfwd(lambda v: t2j.call_jax(lambda a: a ** 2, v))(x[0])
    torch.testing.assert_close(jac.cpu(), torch.diag(2 * x[0].cpu()))
    torch.testing.assert_close(torch.func.hessian(f)(x[1]).cpu(), torch.diag(6 * x[1].cpu()))
    _, tangent = torch.func.jvp(lambda v: t2j.call_jax(jnp.sin, v), (x[0],), (torch.ones(3, device="jax"),))
    torch.testing.assert_close(tangent.cpu(), x[0].cpu().cos())


def test_torch_view_of_numpy_keeps_64_bit_types():
    assert t2j.torch_view(np.ones(2, np.int64)).dtype == torch.int64
    assert t2j.torch_view(np.ones(2)).dtype == torch.float64


@pytest.mark.parametrize("name", ["argmax", "argmin", "max_dim", "median", "mode", "cross_entropy"])
def test_jax_jit_of_torch_index_ops_without_x64(name):
    # torch code traced in 64-bit mode inside a 32-bit jax.jit: int64 indices must still lower
    fns = {"argmax": lambda t: t.argmax(-1), "argmin": lambda t: t.argmin(0), "max_dim": lambda t: t.max(1).indices,
           "median": lambda t: t.median(1).indices, "mode": lambda t: t.mode(1).indices,
           "cross_entropy": lambda t: torch.nn.functional.cross_entropy(t, t.argmax(1))}
    x = jnp.array([[1.0, 5.0, 2.0, 5.0], [7.0, 0.0, 7.0, 0.0]])
    f = t2j.jax_view(fns[name])
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x)), np.asarray(fns[name](torch.tensor(np.asarray(x)))))


def test_torch_func_transforms_through_jax_code_that_calls_torch():
    # torch -> JAX -> torch under torch.func.grad: the inner torch code ran at torch.func's level, its
    # results wrapped tensors that JAX could not read ("Tensor that doesn't have storage")
    def f(t):
        return t2j.call_jax(lambda v: t2j.call_torch(lambda u: torch.tanh(u) ** 2, v).sum() * v.sum(), t)

    def expected(v):
        return (jnp.tanh(v) ** 2).sum() * v.sum()

    x = torch.randn(2, 3, device="jax")
    a = jnp.asarray(x.cpu().numpy())
    np.testing.assert_allclose(torch.func.grad(f)(x[0]).cpu(), jax.grad(expected)(a[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(torch.func.vmap(torch.func.grad(f))(x).cpu(), jax.vmap(jax.grad(expected))(a),
                               rtol=1e-5, atol=1e-6)


def test_call_jax_under_a_vmapped_backward_pass():
    # jacobian(vectorize=True) / is_grads_batched=True refused: the batched cotangents reached JAX as they were
    x = torch.randn(4, device="jax")
    expected = torch.autograd.functional.jacobian(lambda v: torch.sin(v) * v.sum(), x.cpu())
    got = torch.autograd.functional.jacobian(lambda v: t2j.call_jax(lambda u: jnp.sin(u) * u.sum(), v), x,
                                             vectorize=True)
    torch.testing.assert_close(got.cpu(), expected)
    leaf = x.clone().requires_grad_()
    sines, _ = t2j.call_jax(lambda v: (jnp.sin(v), v.sum()), leaf)
    grad, = torch.autograd.grad(sines, leaf, torch.eye(4, device="jax"), is_grads_batched=True)
    torch.testing.assert_close(grad.cpu(), torch.diag(torch.cos(x.cpu())))


def test_call_jax_pytree_outputs_and_no_grad():
    x = torch.arange(4.0, device="jax")
    out = t2j.call_jax(lambda a: {"double": a * 2, "sum": a.sum()}, x)
    assert out["double"].tolist() == [0.0, 2.0, 4.0, 6.0] and out["sum"].item() == 6.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Params:
    w: object
    scale: float = dataclasses.field(default=2.0, metadata={"static": True})


class _Holder:
    def __init__(self, a):
        self.a, self.n = a, 3


def test_call_jax_differentiates_tensors_inside_jax_pytrees_and_objects():
    # torch's pytree took a JAX-registered dataclass (or an object holding tensors) whole: its tensors
    # reached JAX as constants, with no gradient and no error
    x = torch.randn(3, device="jax", requires_grad=True)
    out = t2j.call_jax(lambda p: p.w * p.scale, _Params(x))
    assert out.requires_grad
    out.sum().backward()
    assert x.grad.tolist() == [2.0] * 3
    x.grad = None
    t2j.call_jax(lambda h: (h.a * h.n).sum(), _Holder(x)).backward()
    assert x.grad.tolist() == [3.0] * 3
    cpu = torch.ones(2, requires_grad=True)
    out = t2j.call_jax(lambda p: p.w * p.scale, _Params(cpu))
    assert out.device.type == "cpu" and out.requires_grad
    g = torch.func.grad(lambda v: t2j.call_jax(lambda p: (p.w ** 2).sum(), _Params(v)))(torch.ones(2, device="jax"))
    assert g.tolist() == [2.0, 2.0]


def test_torch_view_of_a_jax_function():
    f = t2j.torch_view(jnp.tanh)
    x = torch.randn(3, device="jax", requires_grad=True)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 1 - torch.tanh(x.detach().cpu()) ** 2)


def test_call_torch_under_jax_grad():
    g = jax.grad(lambda x: t2j.call_torch(lambda t: (t.sin() ** 2).sum(), x))(jnp.arange(3.0))
    np.testing.assert_allclose(g, np.sin(2 * np.arange(3.0)), rtol=1e-6)


def test_jax_loss_over_torch_submodule_trains():
    fn, state = t2j.functionalize(_mlp())
    x, y = _x(16, 4), _x(16, 2)

    @jax.jit
    def step(state, x, y):
        loss, g = jax.value_and_grad(lambda s: jnp.mean((fn(s, x) - y) ** 2))(state)
        return jax.tree.map(lambda p, d: p - 0.1 * d, state, g), loss

    losses = []
    for _ in range(10):
        state, loss = step(state, x, y)
        losses.append(float(loss))
    assert losses[-1] < losses[0] * 0.8


@jax.custom_vjp
def _double_clipping_gradient(x):
    return x * 2.0


_double_clipping_gradient.defvjp(lambda x: (x * 2.0, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


@jax.custom_jvp
def _sine_with_slope_100(x):
    return jnp.sin(x)


_sine_with_slope_100.defjvp(lambda p, t: (jnp.sin(p[0]), 100.0 * t[0]))


@pytest.mark.parametrize("how", ["eager", "jitted forward", "jitted step"])
def test_call_jax_keeps_jax_custom_derivative_rules(how):
    w = torch.tensor([1.0, 2.0], device="jax", requires_grad=True)

    def forward(x):
        return t2j.call_jax(_double_clipping_gradient, w * x).sum() + t2j.call_jax(_sine_with_slope_100, w).sum()

    def step(x):
        loss = forward(x)
        loss.backward()
        return loss

    x = torch.tensor([3.0, 4.0], device="jax")
    if how == "jitted step":
        t2j.jit(step)(x)
    else:
        (t2j.jit(forward) if how == "jitted forward" else forward)(x).backward()
    # the rules' gradients: clip(1, -0.1, 0.1) * x and 100, not JAX's derivative of the functions
    torch.testing.assert_close(w.grad.cpu(), torch.tensor([100.3, 100.4]))


def test_call_jax_inside_jitted_training_step():
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    ref = nn.Linear(3, 3)
    ref.load_state_dict(lin.state_dict())
    lin.to("jax")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    @t2j.jit
    def step(x):
        opt.zero_grad()
        loss = t2j.call_jax(jnp.tanh, lin(x)).pow(2).sum()
        loss.backward()
        opt.step()
        return loss

    x = torch.randn(2, 3)
    for _ in range(3):
        ref_opt.zero_grad()
        expected = torch.tanh(ref(x)).pow(2).sum()
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(step(x.to("jax")).cpu(), expected.detach(), atol=1e-5, rtol=1e-5)


def test_random_ops_under_plain_jax_jit_need_a_key_and_leave_eager_rng_intact():
    f = t2j.jax_view(lambda x: torch.nn.functional.dropout(x, 0.5))
    torch.manual_seed(0)
    expected = torch.rand(4, device="jax").cpu()
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="no RNG key"):
        jax.jit(f)(jnp.ones(8))

    def keyed(x, key):
        with t2j.rng_key(key):
            return f(x)

    a = jax.jit(keyed)(jnp.ones(8), jax.random.key(1))
    b = jax.jit(keyed)(jnp.ones(8), jax.random.key(2))
    assert not np.array_equal(a, b)
    # the eager stream is where it was before the traced calls
    assert torch.equal(torch.rand(4, device="jax").cpu(), expected)


def _dropout_of_ones(_=None):
    return t2j.call_torch(lambda t: torch.nn.functional.dropout(t, 0.5), jnp.ones(16))


def test_draws_in_a_jax_loop_or_vmap_inside_an_rng_key_block_are_refused_not_repeated():
    # traced once, the body would draw the same mask at every iteration
    def scanned(key):
        with t2j.rng_key(key):
            return jax.lax.scan(lambda c, _: (c, _dropout_of_ones()), 0.0, None, length=4)[1]

    with pytest.raises(RuntimeError, match="same numbers"):
        jax.jit(scanned)(jax.random.key(0))

    def vmapped(key):
        with t2j.rng_key(key):
            return jax.vmap(_dropout_of_ones)(jnp.arange(3))

    with pytest.raises(RuntimeError, match="same numbers"):
        jax.jit(vmapped)(jax.random.key(0))

    # a key per iteration, the block entered in the body, draws a mask per iteration
    def keyed_body(c, key):
        with t2j.rng_key(key):
            return c, _dropout_of_ones()

    masks = jax.jit(lambda k: jax.lax.scan(keyed_body, 0.0, jax.random.split(k, 4))[1])(jax.random.key(0))
    assert len({tuple(np.asarray(m)) for m in masks}) == 4


def test_draws_in_a_jax_checkpoint_or_cond_inside_an_rng_key_block_leak_no_key():
    @jax.jit
    def f(key):
        with t2j.rng_key(key) as r:
            remat = jax.checkpoint(_dropout_of_ones)()
            cond = jax.lax.cond(True, _dropout_of_ones, lambda _: jnp.ones(16), None)
            after = _dropout_of_ones()
        return jnp.stack([remat, cond, after]), jax.random.key_data(r.key)

    masks, _ = f(jax.random.key(0))
    assert len({tuple(np.asarray(m)) for m in masks}) == 3


def test_plain_jax_jit_cannot_leak_a_tracer_into_a_parameter():
    lin = nn.Linear(3, 3).to("jax")
    before = lin.weight.detach().cpu().clone()

    def mutate(x):
        with torch.no_grad():
            lin.weight.add_(x)
        return lin.weight * 1

    with pytest.raises(RuntimeError, match="escape the trace"):
        jax.jit(t2j.jax_view(mutate))(jnp.ones(3))
    assert torch.equal(lin.weight.detach().cpu(), before)
    # local tensors created inside the traced function may be mutated freely
    local = jax.jit(t2j.jax_view(lambda x: torch.zeros(3, device="jax").add_(x)))(jnp.ones(3))
    np.testing.assert_array_equal(local, np.ones(3))


def _fill_a_fresh_buffer(t):
    buf = torch.zeros_like(t)  # made inside the function, then written in place with traced values
    buf[0] = t[1]
    buf += t
    return buf


def test_buffers_the_torch_code_allocates_take_traced_writes_under_eager_transforms():
    x = jnp.arange(3.0)
    torch_x = torch.arange(3.0)
    got = jax.grad(lambda v: t2j.call_torch(_fill_a_fresh_buffer, v).sum())(x)
    np.testing.assert_array_equal(got, torch.func.grad(lambda t: _fill_a_fresh_buffer(t).sum())(torch_x))
    xs = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(jax.vmap(lambda v: t2j.call_torch(_fill_a_fresh_buffer, v))(xs),
                                  torch.func.vmap(_fill_a_fresh_buffer)(torch.arange(6.0).reshape(2, 3)))
    _, tangent = jax.jvp(lambda v: t2j.call_torch(_fill_a_fresh_buffer, v), (x,), (jnp.ones(3),))
    _, want = torch.func.jvp(_fill_a_fresh_buffer, (torch_x,), (torch.ones(3),))
    np.testing.assert_array_equal(tangent, want)
    # a buffer the code closes over is still refused: the tracer would outlive the call
    norm = nn.BatchNorm1d(3).to("jax")

    def mutate(v):
        norm.running_mean.add_(v)
        return (norm.running_mean * v).sum()

    with pytest.raises(RuntimeError, match="escape the trace"):
        jax.grad(t2j.jax_view(mutate))(jnp.ones(3))


def test_torch_code_writing_into_its_argument_under_jax_grad():
    def accumulate(x, acc):
        acc += x * 2
        return acc

    x = jnp.arange(3.0)
    got = jax.grad(lambda v: t2j.call_torch(accumulate, v, jnp.zeros(3)).sum())(x)
    want = torch.func.grad(lambda t: accumulate(t, torch.zeros(3)).sum())(torch.arange(3.0))
    np.testing.assert_array_equal(got, want)

    class Accumulate(nn.Module):
        def forward(self, x, acc):
            return accumulate(x, acc)

    fn, state = t2j.functionalize(Accumulate())
    np.testing.assert_array_equal(jax.grad(lambda v: fn(state, v, jnp.zeros(3)).sum())(x), want)


def test_stock_rnn_writing_in_place_under_eager_jax_grad_matches_torch():
    # nn.RNN's decomposition fills its output buffer in place
    torch.manual_seed(0)
    rnn = nn.RNN(4, 5, batch_first=True)
    fn, state = t2j.functionalize(copy.deepcopy(rnn).to("jax"))
    x = _x(2, 3, 4)
    got = jax.grad(lambda v: fn(state, v)[0].sum())(x)
    xt = torch.tensor(x, requires_grad=True)
    rnn(xt)[0].sum().backward()
    np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert jax.vmap(lambda v: fn(state, v[None])[0])(x).shape == (2, 1, 3, 5)


def test_functionalize_with_closed_over_state_under_transforms():
    # the state's tensors are made for the call: a transform may write its tracers into them
    fn, state = t2j.functionalize(nn.BatchNorm1d(3))
    x = jnp.arange(12.0).reshape(4, 3)
    out, new = jax.jit(fn.apply)(state, x)
    closed_out, closed_new = jax.jit(lambda v: fn.apply(state, v))(x)
    np.testing.assert_allclose(closed_out, out)
    np.testing.assert_allclose(closed_new["buffers"]["running_mean"], new["buffers"]["running_mean"])
    assert jax.grad(lambda v: (fn(state, v) ** 3).sum())(x).shape == (4, 3)
    assert jax.vmap(fn, in_axes=(None, 0))(state, jnp.stack([x, x])).shape == (2, 4, 3)
    np.testing.assert_array_equal(state["buffers"]["running_mean"], np.zeros(3))  # the state itself is unchanged


def test_torch_func_grad_through_call_jax_with_an_integer_argument():
    w = torch.randn(5, 3)
    ids = torch.tensor([0, 2, 2])

    def loss(w, ids):
        return t2j.call_jax(lambda w, i: jnp.sum(w[i] ** 2), w, ids)

    got = torch.func.grad(loss)(w.to("jax"), ids.to("jax"))
    want = torch.func.grad(lambda w, ids: (w[ids] ** 2).sum())(w, ids)
    np.testing.assert_allclose(got.cpu().numpy(), want.numpy(), rtol=1e-6)
    jac = torch.func.jacrev(loss)(w.to("jax"), ids.to("jax"))
    np.testing.assert_allclose(jac.cpu().numpy(), want.numpy(), rtol=1e-6)


def test_call_jax_returns_python_values_as_they_are_with_grad():
    x = torch.ones(3, device="jax", requires_grad=True)
    out = t2j.call_jax(lambda x: {"loss": (x ** 2).sum(), "n": 3, "name": "sq"}, x)
    assert out["n"] == 3 and out["name"] == "sq"
    out["loss"].backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_torch_view_passes_typed_keys_through():
    key = jax.random.key(0)
    tree = t2j.torch_view({"x": jnp.ones(2), "key": key})
    assert isinstance(tree["x"], t2j.Tensor) and tree["key"] is key
    y = t2j.call_jax(lambda x, k: x + jax.random.normal(k, x.shape), tree["x"], tree["key"])
    np.testing.assert_allclose(y.cpu().numpy(), 1 + np.asarray(jax.random.normal(key, (2,))), rtol=1e-6)


def test_without_x64_call_torch_and_functionalize_trade_ints_as_jax_and_torch_expect():
    assert not jax.config.jax_enable_x64
    x = jnp.arange(3.0)
    i = t2j.call_torch(lambda t: t.argmax(), x)
    assert i.dtype == jnp.int32  # JAX's own integers, which lax.cond and scan carries must match
    assert int(jax.lax.cond(True, lambda x: t2j.call_torch(lambda t: t.argmax(), x), jnp.argmax, x)) == 2
    # JAX's int32 labels reach torch as int64, which cross_entropy requires
    model = nn.Linear(4, 3)
    fn, state = t2j.functionalize(model)
    data, labels = _x(6, 4), np.array([0, 2, 1, 1, 0, 2], np.int32)
    loss = jax.jit(lambda s, x, y: t2j.call_torch(nn.functional.cross_entropy, fn(s, x), y))(state, data, labels)
    want = nn.functional.cross_entropy(model(torch.from_numpy(data)), torch.from_numpy(labels).long())
    np.testing.assert_allclose(float(loss), want.item(), rtol=1e-5)
    assert t2j.call_torch(lambda t: t.double(), x).dtype == jnp.float32


def test_jit_retraces_when_a_jax_array_it_reads_is_replaced():
    class Config:
        mask = jnp.array([1.0, 0.0, 1.0])

    cfg = Config()
    step = t2j.jit(lambda x: t2j.call_jax(lambda v: v * cfg.mask, x))
    x = torch.ones(3, device="jax")
    assert step(x).tolist() == [1.0, 0.0, 1.0]
    cfg.mask = jnp.array([0.0, 3.0, 0.0])
    assert step(x).tolist() == [0.0, 3.0, 0.0]
    assert step.stats["traces"] == 2
    step(x)
    assert step.stats["traces"] == 2


GLOBAL_SCALE = jnp.array([2.0, 2.0])


def test_jit_retraces_when_a_global_jax_array_it_reads_is_replaced():
    global GLOBAL_SCALE
    step = t2j.jit(lambda x: x * t2j.torch_view(GLOBAL_SCALE))
    x = torch.ones(2, device="jax")
    assert step(x).tolist() == [2.0, 2.0]
    GLOBAL_SCALE = jnp.array([5.0, 6.0])
    assert step(x).tolist() == [5.0, 6.0]


def test_call_torch_under_jax_jit_keeps_item_numbers_traced():
    table = torch.arange(4)

    def with_cpu_table(x):  # torch would compute with a placeholder for the number
        return (table + x.sum().int().item()).sum().to(x.device)

    with pytest.raises(t2j.OpError, match="add computed a CPU tensor from a traced number"):
        jax.jit(lambda a: t2j.call_torch(with_cpu_table, a))(jnp.ones(3))

    def pick(x):
        return x[(x.sum() / 5).int().item()] * 2

    assert float(jax.jit(lambda a: t2j.call_torch(pick, a))(jnp.arange(5.0))) == 4.0


def test_call_torch_indexes_with_0d_tensors_under_jax_jit_and_vmap():
    # ``u[j]`` with ``j`` a 0-d tensor whose value JAX traces: torch's indexing asks for the value (a select)
    a = jnp.arange(6.0).reshape(2, 3)
    row = jax.jit(lambda a, i: t2j.call_torch(lambda u, j: u[j] * 2, a, i))(a, jnp.array(1))
    np.testing.assert_array_equal(row, [6.0, 8.0, 10.0])
    picked = jax.vmap(lambda r, i: t2j.call_torch(lambda u, j: u[j], r, i))(a, jnp.array([0, 2]))
    np.testing.assert_array_equal(picked, [0.0, 5.0])

    def put(u, j):
        u = u.clone()
        u[:, j] = -1.0
        return u

    np.testing.assert_array_equal(jax.jit(lambda a, i: t2j.call_torch(put, a, i))(a, jnp.array(2)),
                                  [[0.0, 1.0, -1.0], [3.0, 4.0, -1.0]])


def test_call_torch_returning_item_numbers_under_jax_jit_gives_jax_scalars():
    def metrics(t):
        return {"sum": t.sum().item(), "count": t.long().sum().item(), "positive": (t > 0).all().item(),
                "scaled": t.sum().item() * 2 + 1}

    got = jax.jit(lambda a: t2j.call_torch(metrics, a))(jnp.ones(4))
    assert all(isinstance(v, jax.Array) for v in got.values())
    # as eagerly (Python numbers), in JAX's 32-bit types as its own scalars
    assert {k: v.item() for k, v in got.items()} == t2j.call_torch(metrics, jnp.ones(4))
    assert {k: v.dtype for k, v in got.items()} == {"sum": jnp.float32, "count": jnp.int32, "positive": jnp.bool_,
                                                    "scaled": jnp.float32}
    np.testing.assert_allclose(jax.jit(lambda a: t2j.call_torch(metrics, a)["sum"] + a)(jnp.ones(2)), [3.0, 3.0])


def test_functionalize_refuses_a_state_of_another_structure():
    # a name the module does not have would be ignored (its own tensor used: zero gradients)
    fn, state = t2j.functionalize(torch.nn.Linear(3, 1).to("jax"))
    x = jnp.ones((2, 3))
    with pytest.raises(TypeError, match="must be .'params'"):
        fn(state["params"], x)
    with pytest.raises(KeyError, match="biass"):
        fn({"params": {"weight": state["params"]["weight"], "biass": state["params"]["bias"]}}, x)
    grads = jax.grad(lambda p: fn({"params": p}, x).sum())(state["params"])  # (a partial state is allowed)
    np.testing.assert_allclose(grads["weight"], np.full((1, 3), 2.0))


def _scan_and_loop(x):
    c, ys = t2j.scan(lambda c, xi: (c + xi.sin(), c * 2), torch.zeros(3, device=x.device, dtype=x.dtype), x)
    return c.sum() + ys.sum() + t2j.fori_loop(0, 3, lambda i, v: v * 2 + i, x[0]).sum()


def test_functionalize_names_a_bad_argument():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    fn, state = t2j.functionalize(model)
    x = jnp.ones((1, 3))
    for rng, got in [(0, "got int"), (jnp.ones(2), "dtype float32"),
                     (jax.random.split(jax.random.key(0), 2), "vmap over them")]:
        with pytest.raises(TypeError, match=f"functionalize: the function's rng= must be a single JAX PRNG key.*{got}"):
            fn(state, x, rng=rng)
    assert fn(state, x, rng=jax.random.PRNGKey(0)).shape == (1, 3)  # (a raw key too)
    with pytest.raises(TypeError, match="t2j.rng_key: key must be a single JAX PRNG key"):
        t2j.rng_key(0)
    torch_state = {"params": {k: torch.tensor(np.asarray(v)) for k, v in state["params"].items()}}
    with pytest.raises(TypeError, match=r"functionalize: state\['params'\]\['0.weight'\] is a Tensor"):
        fn(torch_state, x, rng=jax.random.key(0))
    with pytest.raises(TypeError, match="functionalize: module must be a torch.nn.Module, got function"):
        t2j.functionalize(lambda t: t)


@pytest.mark.parametrize("transform", ["jax.jit", "jax.grad", "jax.vmap"])
def test_torch_control_flow_drawing_nothing_needs_no_key_under_jax(transform):
    x = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
    f = functools.partial(t2j.call_torch, _scan_and_loop)
    got = {"jax.jit": jax.jit(f), "jax.grad": jax.grad(f), "jax.vmap": jax.vmap(f)}[transform](
        jnp.asarray(np.stack([x, -x]) if transform == "jax.vmap" else x))
    if transform == "jax.grad":
        xt = torch.tensor(x, requires_grad=True)
        _scan_and_loop(xt).backward()
        expected = xt.grad
    elif transform == "jax.vmap":
        expected = torch.stack([_scan_and_loop(torch.tensor(v)) for v in (x, -x)])
    else:
        expected = _scan_and_loop(torch.tensor(x))
    np.testing.assert_allclose(np.asarray(got), expected.detach().numpy(), rtol=1e-5)


def test_rng_key_entered_outside_jax_jit_is_refused():
    noisy = functools.partial(t2j.call_torch, lambda t: t + torch.rand_like(t))
    with t2j.rng_key(jax.random.key(0)), pytest.raises(RuntimeError, match="entered outside it"):
        jax.jit(noisy)(jnp.ones(2))

    @jax.jit
    def inside(a, key):
        with t2j.rng_key(key):
            return noisy(a)

    first, second = inside(jnp.ones(2), jax.random.key(0)), inside(jnp.ones(2), jax.random.key(1))
    assert not np.allclose(first, second)
    np.testing.assert_array_equal(first, inside(jnp.ones(2), jax.random.key(0)))
    with t2j.rng_key(jax.random.key(0)):  # (jax.grad splits a concrete key concretely: nothing is baked in)
        got = jax.grad(lambda a: noisy(a).sum())(jnp.ones(2))
    np.testing.assert_allclose(got, np.ones(2))


def test_distribution_argument_validation_under_jax_jit():
    def log_prob(mu, scale, x):
        return torch.distributions.Normal(mu, scale, validate_args=True).log_prob(x).sum()

    f = jax.jit(functools.partial(t2j.call_torch, log_prob))
    mu, x = np.zeros(3, np.float32), np.linspace(-1, 1, 3, dtype=np.float32)
    expected = log_prob(torch.tensor(mu), torch.ones(3), torch.tensor(x))
    np.testing.assert_allclose(f(mu, np.ones(3, np.float32), x), expected.numpy(), rtol=1e-6)
    # an invalid scale fails the program's check when it runs (a bool() of the traced check raised before)
    with pytest.raises(Exception, match="does not satisfy its constraint"):
        jax.block_until_ready(f(mu, -np.ones(3, np.float32), x))


def test_donated_functional_state_is_written_back_to_the_module():
    torch.manual_seed(0)
    ref = nn.Linear(3, 2)
    model = copy.deepcopy(ref).to("jax")
    fn, state = t2j.functionalize(model)
    x = np.ones((4, 3), np.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def sgd(state, x):
        grads = jax.grad(lambda s: fn(s, x).sum())(state)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)

    state = sgd(state, x)
    with pytest.raises(t2j.OpError, match="donated to a JAX program.*write_back"):
        model(torch.ones(1, 3, device="jax"))
    fn.write_back(state)
    ref(torch.from_numpy(x)).sum().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), msg=n)
    assert all(p.requires_grad for p in model.parameters())


def test_jitted_function_takes_and_returns_jax_arrays_as_program_inputs_and_outputs():
    # a jax.Array argument was a constant keyed by identity (a new PRNG key per call compiled a new program
    # every call), and a JAX value the function returned was the trace's tracer
    x = torch.ones(3, device="jax")

    def noisy(x, key):
        key, sub = jax.random.split(key)
        return x + t2j.call_jax(lambda s: jax.random.normal(s, (3,)), sub), key, jnp.sin(t2j.jax_view(x))

    step = t2j.jit(noisy)
    key = eager_key = jax.random.key(0)
    for _ in range(3):
        y, key, s = step(x, key)
        y_eager, eager_key, _ = noisy(x, eager_key)
        torch.testing.assert_close(y, y_eager)
        assert (jax.random.key_data(key) == jax.random.key_data(eager_key)).all()
        assert type(s) is type(jnp.ones(1)) and np.allclose(s, np.sin(1.0))
    assert step.stats["traces"] == 1
    scaled = t2j.jit(lambda x, m: x * float(np.asarray(m).sum()))  # a value the trace needs: a constant, as before
    assert scaled(x, jnp.ones(3)).tolist() == [3.0] * 3 and scaled(x, jnp.ones(2)).tolist() == [2.0] * 3


def test_jitted_function_takes_the_arrays_inside_a_jax_pytree_argument_as_inputs():
    # a jax.tree_util dataclass argument was one leaf keyed by identity: every new batch compiled a new program
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Batch:
        mask: jax.Array
        x: torch.Tensor
        scale: float = dataclasses.field(metadata=dict(static=True), default=2.0)

    w = torch.randn(4, device="jax")
    f = t2j.jit(lambda b, bias=None: (b.x * w * t2j.torch_view(b.mask)).sum() * b.scale)
    for i in range(3):
        b = Batch(jnp.arange(4.0) + i, torch.full((4,), float(i), device="jax"))
        torch.testing.assert_close(f(b, None).cpu(), (b.x.cpu() * w.cpu() * torch.arange(4.0).add(i)).sum() * 2)
    assert f.stats["traces"] == 1
    assert torch.utils._pytree.tree_leaves([None]) == [None]  # (JAX's pytree has None as a node: torch's unchanged)
    torch.testing.assert_close(f(Batch(jnp.ones(4), torch.ones(4, device="jax"), 3.0), None).cpu(), w.cpu().sum() * 3)
    assert f.stats["traces"] == 2  # (a new static field: a new program)


def test_jitted_call_on_donated_arrays_names_the_tensor():
    # XLA's "Invalid buffer passed to Execute()" named neither the tensor nor the donation
    donate = jax.jit(lambda a: a + 1, donate_argnums=0)
    double = t2j.jit(lambda x: x * 2)
    for called_before in (False, True):
        a = jnp.arange(4.0)
        t = t2j.torch_view(a)
        if called_before:
            double(t)
        donate(a)
        with pytest.raises(t2j.OpError, match=r"argument.*float32\[4\].*donated to a JAX program"):
            double(t)
    model = nn.Linear(3, 2).to("jax")
    _, state = t2j.functionalize(model)
    jax.jit(lambda s: s, donate_argnums=0)(state)
    with pytest.raises(t2j.OpError, match=r"Linear.weight .*donated.*write_back"):
        t2j.jit(model)(torch.ones(1, 3, device="jax"))


@pytest.mark.parametrize("move", [lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.numpy()])
def test_moving_a_traced_tensor_to_the_host_says_what_to_do(move):
    with pytest.raises(t2j.OpError, match=r"not known until the program runs.*return it and move it after the call"):
        jax.jit(functools.partial(t2j.call_torch, lambda t: torch.as_tensor(move(t)).sum()))(jnp.arange(3.0))


_ROW_WRITES = {  # (torch's in-place write, JAX's)
    "y[1:] += 1": (lambda y: y[1:].add_(1.0), lambda x: x.at[1:].add(1.0)),
    "y[1] = 2": (lambda y: y.__setitem__(1, 2.0), lambda x: x.at[1].set(2.0)),
    "y[1, 2] = 2": (lambda y: y.__setitem__((1, 2), 2.0), lambda x: x.at[1, 2].set(2.0)),
}


@pytest.mark.parametrize("write", list(_ROW_WRITES))
def test_per_example_gradients_of_torch_code_writing_a_row_in_place(write):
    torch_write, jax_write = _ROW_WRITES[write]

    def torch_fn(t):
        y = t.clone()
        torch_write(y)
        return (y ** 2).sum()

    xs = jnp.arange(24.0).reshape(4, 2, 3)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda x: t2j.call_torch(torch_fn, x)))(xs),
                               jax.vmap(jax.grad(lambda x: (jax_write(x) ** 2).sum()))(xs))


@pytest.mark.parametrize("transform", ["hessian", "jvp"])
def test_forward_mode_through_call_jax_with_integer_and_bool_arguments(transform):
    a, idx = torch.arange(4.0, device="jax"), torch.tensor([0, 2], device="jax")
    mask = torch.tensor([True, False, True, True], device="jax")

    def f(backend):
        if backend == "jax":
            return lambda v: t2j.call_jax(lambda v, i, m: (jnp.where(m, v, 0.0)[i] ** 2).sum(), v, idx, mask)
        return lambda v: (torch.where(mask, v, 0.0)[idx] ** 2).sum()

    if transform == "hessian":
        torch.testing.assert_close(torch.func.hessian(f("jax"))(a), torch.func.hessian(f("torch"))(a))
    else:
        tangent = (torch.ones(4, device="jax"),)
        torch.testing.assert_close(torch.func.jvp(f("jax"), (a,), tangent), torch.func.jvp(f("torch"), (a,), tangent))


def test_call_jax_returning_a_prng_key_with_gradients():
    def noisy(x, key):
        key, sub = jax.random.split(key)
        return x * 2 + jax.random.normal(sub, x.shape), key

    x = torch.ones(3, device="jax", requires_grad=True)
    out, key = t2j.call_jax(noisy, x, jax.random.key(0))
    out.sum().backward()
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    torch.testing.assert_close(x.grad.cpu(), torch.full((3,), 2.0))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32_through_the_views_call_jax_and_call_torch_is_complex64():
    # JAX has no complex32: its values cross as complex64, as x.jax() of a jax-device one
    c = torch.tensor([1 + 1j, 2 - 0.5j], dtype=torch.complex32)
    want = c.to(torch.complex64).numpy()
    for got in (t2j.jax_view(c), t2j.call_jax(lambda a: a, c).numpy(),
                t2j.call_torch(lambda t: t.to(torch.complex32), jnp.asarray(want)),
                jax.jit(lambda a: t2j.call_torch(lambda t: t.to(torch.complex32), a))(jnp.asarray(want))):
        assert got.dtype == np.complex64
        np.testing.assert_array_equal(got, want)
    x = c.clone().requires_grad_()
    t2j.call_jax(lambda a: jnp.abs(a * 2).sum(), x).backward()
    ref = c.to(torch.complex64).requires_grad_()
    (ref * 2).abs().sum().backward()
    assert x.grad.dtype == torch.complex32
    torch.testing.assert_close(x.grad.to(torch.complex64), ref.grad, atol=1e-3, rtol=1e-3)
