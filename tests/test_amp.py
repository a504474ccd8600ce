"""torch.autocast("jax") / t2j.amp.autocast against torch's CPU autocast and float32 torch."""

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import torch2jax as t2j

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402

BF16 = torch.bfloat16


def _inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "a": r(4, 8), "b": r(8, 5), "w": r(5, 8), "bias": r(5), "v": r(8), "c": r(4, 5),
        "x3": r(2, 4, 8), "y3": r(2, 8, 3), "z3": r(2, 4, 3),
        "img": r(2, 3, 8, 8), "k": r(4, 3, 3, 3), "q": r(1, 2, 6, 8),
        "p": r(4, 8).abs() + 0.5, "t": torch.tensor([0, 3, 1, 7]),
    }


# Ops torch's CPU autocast has a rule for (or leaves alone), with float32 inputs: the jax
# device must give the same dtypes, and values within bfloat16 rounding of CPU autocast's.
CPU_TABLE = {
    "mm": lambda i: i["a"] @ i["b"],
    "matmul3d": lambda i: torch.matmul(i["x3"], i["y3"]),
    "linear": lambda i: F.linear(i["a"], i["w"], i["bias"]),
    "addmm": lambda i: torch.addmm(i["c"], i["a"], i["b"]),
    "bmm": lambda i: torch.bmm(i["x3"], i["y3"]),
    "baddbmm": lambda i: torch.baddbmm(i["z3"], i["x3"], i["y3"]),
    "conv2d": lambda i: F.conv2d(i["img"], i["k"], padding=1),
    "conv_transpose2d": lambda i: F.conv_transpose2d(i["img"], i["k"].transpose(0, 1)),
    "sdpa": lambda i: F.scaled_dot_product_attention(i["q"], i["q"], i["q"], is_causal=True),
    "prelu": lambda i: F.prelu(i["a"], torch.full((1,), 0.25, device=i["a"].device)),
    "mse_loss": lambda i: F.mse_loss(i["a"], i["p"]),
    "l1_loss": lambda i: F.l1_loss(i["a"], i["p"]),
    "cross_entropy": lambda i: F.cross_entropy(i["a"], i["t"]),
    "nll_loss": lambda i: F.nll_loss(i["a"], i["t"]),
    "bce_with_logits": lambda i: F.binary_cross_entropy_with_logits(i["a"], i["p"].clamp(max=1)),
    "kl_div": lambda i: F.kl_div(i["a"], i["p"], reduction="batchmean"),
    "prod": lambda i: i["p"].prod(),
    "cdist": lambda i: torch.cdist(i["a"], i["a"]),
    "linalg_inv": lambda i: torch.linalg.inv(i["a"][:, :4] + 4 * torch.eye(4, device=i["a"].device)),
    "cat_mixed": lambda i: torch.cat([i["a"], i["a"].to(BF16)]),
    "cat_bf16": lambda i: torch.cat([i["a"].to(BF16), i["a"].to(BF16)]),
    "stack_mixed": lambda i: torch.stack([i["a"].to(BF16), i["a"]]),
    "softmax": lambda i: torch.softmax(i["a"], -1),
    "layer_norm": lambda i: F.layer_norm(i["a"], (8,)),
    "exp": lambda i: i["a"].exp(),
    "sum": lambda i: i["a"].sum(1),
    "gelu": lambda i: F.gelu(i["a"]),
    "relu_bf16": lambda i: torch.relu(i["a"].to(BF16)),
    "add_mixed": lambda i: i["a"] + i["a"].to(BF16),
}


def _on(inputs, device):
    return {k: v.to(device) for k, v in inputs.items()}


def _cpu_autocast(fn, inputs):
    with torch.autocast("cpu", dtype=BF16):
        return fn(inputs)


def _jax_autocast(fn, inputs):
    with t2j.env(), torch.autocast("jax", dtype=BF16):
        return fn(_on(inputs, "jax"))


@pytest.mark.parametrize("name", sorted(CPU_TABLE))
def test_dtype_and_value_match_cpu_autocast(name):
    fn, inputs = CPU_TABLE[name], _inputs()
    expected, got = _cpu_autocast(fn, inputs), _jax_autocast(fn, inputs)
    assert got.device.type == "jax"
    assert got.dtype == expected.dtype, name
    tol = 2e-2 if expected.dtype == BF16 else 1e-5
    try:
        torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=tol, atol=tol)
    except AssertionError:
        if expected.dtype != BF16:
            raise
        # bfloat16 kernels round partial sums differently per CPU (oneDNN picks by ISA):
        # then ours must be as close to the exact result on the bfloat16-rounded inputs as torch's
        exact = fn({k: v.to(BF16).double() if v.is_floating_point() else v for k, v in inputs.items()})
        ours, torchs = (got.cpu().double() - exact).abs(), (expected.double() - exact).abs()
        assert bool((ours <= tol * (1 + exact.abs()) + 2 * torchs.max()).all()), (ours.max(), torchs.max())


# Ops that torch's CUDA autocast runs in float32 but its CPU autocast leaves alone: on the
# jax device a bfloat16 input gives a float32 result, computed as torch does on the
# input in float32.
FP32_ON_BF16 = {
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: F.log_softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, (8,)),
    "group_norm": lambda x: F.group_norm(x, 2),
    "exp": torch.exp,
    "log1p": lambda x: torch.log1p(x.abs()),
    "pow": lambda x: x.pow(3),
    "rsqrt": lambda x: x.abs().rsqrt(),
    "softplus": F.softplus,
    "sum": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(dim=1),
    "cumsum": lambda x: x.cumsum(1),
    "vector_norm": lambda x: torch.linalg.vector_norm(x, dim=-1),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "norm_dim": lambda x: torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1]),
    "norm_scalar": lambda x: torch.ops.aten.norm.Scalar(x, 2),
}


@pytest.mark.parametrize("name", sorted(FP32_ON_BF16))
def test_fp32_list_upcasts_bfloat16(name):
    fn = FP32_ON_BF16[name]
    x = _inputs()["a"].to(BF16)
    expected = fn(x.float())
    with t2j.env(), torch.autocast("jax", dtype=BF16):
        got = fn(x.to("jax"))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_explicit_dtype_and_float64_are_kept():
    x = _inputs()["a"]
    with t2j.env(), torch.autocast("jax", dtype=BF16):
        xj = x.to("jax")
        assert torch.softmax(xj.to(BF16), -1, dtype=BF16).dtype == BF16
        assert xj.sum(dtype=torch.float64).dtype == torch.float64
        d = xj.double()
        assert (d @ d.T).dtype == torch.float64
        assert torch.softmax(d, -1).dtype == torch.float64
        assert (xj.long() @ xj.long().T).dtype == torch.int64


def test_cpu_tensors_and_other_devices_unaffected():
    a = _inputs()["a"]
    with t2j.env(), torch.autocast("jax", dtype=BF16):
        assert (a @ a.T).dtype == torch.float32
    with t2j.env(), torch.autocast("cpu", dtype=BF16):
        aj = a.to("jax")
        assert (aj @ aj.T).dtype == torch.float32


def test_nested_enabled_false_and_alias():
    a = _inputs()["a"]
    with t2j.env():
        aj = a.to("jax")
        with t2j.amp.autocast():
            assert torch.is_autocast_enabled("jax") and torch.get_autocast_dtype("jax") == BF16
            assert (aj @ aj.T).dtype == BF16
            with torch.autocast("jax", enabled=False):
                assert (aj @ aj.T).dtype == torch.float32
            assert (aj @ aj.T).dtype == BF16
        assert (aj @ aj.T).dtype == torch.float32
        with t2j.amp.autocast(torch.float16):
            assert (aj @ aj.T).dtype == torch.float16


def test_float16_matches_cpu_autocast():
    i = _inputs()
    with torch.autocast("cpu", dtype=torch.float16):
        expected = F.linear(i["a"], i["w"])
    with t2j.env(), t2j.amp.autocast(torch.float16):
        got = F.linear(i["a"].to("jax"), i["w"].to("jax"))
    assert got.dtype == expected.dtype == torch.float16
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-3, atol=2e-3)


def test_bad_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match=r"t2j.amp.autocast: dtype must be .*got torch.int8"):
        t2j.amp.autocast(torch.int8)


def test_every_rule_names_an_op_of_this_torch():
    from torch2jax import amp

    names = (*amp.LOWER_PRECISION, *amp.FP32, *amp.FP32_SET_OPT_DTYPE, *amp.FP32_APPEND_DTYPE.values(),
             *amp.PROMOTE, *amp.FP32_APPEND_DTYPE)
    missing = [n for n in names if amp.overload(n) is None]
    assert missing == []
    assert amp.rules()[torch.ops.aten.linear.default] == "lower_precision"
    assert amp.rules()[torch.ops.aten.softmax.int] == "fp32_set_opt_dtype"


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def _grads(model, x, y, device):
    model = copy.deepcopy(model).to(device)
    with torch.autocast(device, dtype=BF16):
        out = model(x.to(device))
        loss = F.cross_entropy(out, y.to(device))
    loss.backward()
    return out, loss, {n: p.grad for n, p in model.named_parameters()}


def test_gradients_flow_in_parameter_dtype_and_match_cpu_autocast():
    torch.manual_seed(0)
    model, x, y = _Net(), torch.randn(6, 8), torch.randint(0, 4, (6,))
    out_c, loss_c, grads_c = _grads(model, x, y, "cpu")
    with t2j.env():
        out_j, loss_j, grads_j = _grads(model, x, y, "jax")
    assert out_j.dtype == out_c.dtype == BF16 and loss_j.dtype == loss_c.dtype == torch.float32
    for name, g in grads_c.items():
        assert grads_j[name].dtype == g.dtype == torch.float32, name
        torch.testing.assert_close(grads_j[name].cpu(), g, rtol=3e-2, atol=3e-3)


def _train(base, device, *, amp, jit, steps=10):
    """Losses of ``steps`` AdamW steps of a copy of ``base`` (a GPT, or an MLP classifier)."""
    torch.manual_seed(0)
    model = copy.deepcopy(base).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if isinstance(base, gpt.GPT):
        idx = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(1))
        x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)
    else:
        x, y = torch.randn(16, 8).to(device), torch.randint(0, 4, (16,)).to(device)

    def step(x, y):
        opt.zero_grad()
        with torch.autocast(device, dtype=BF16, enabled=amp):
            out = model(x, y) if isinstance(model, gpt.GPT) else (None, F.cross_entropy(model(x), y))
        loss = out[1]
        loss.backward()
        opt.step()
        return loss

    step = t2j.jit(step) if jit else step
    losses = [step(x, y).item() for _ in range(steps)]
    return torch.tensor(losses), model


def _tiny_gpt():
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32))


def test_jit_mlp_training_under_autocast_tracks_float32_training():
    torch.manual_seed(0)
    base = _Net()
    fp32, _ = _train(base, "cpu", amp=False, jit=False)
    with t2j.env():
        amp, model = _train(base, "jax", amp=True, jit=True)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert amp[-1] < amp[0] - 0.1
    torch.testing.assert_close(amp, fp32, rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_training_under_autocast_tracks_float32_training():
    base = _tiny_gpt()
    fp32, _ = _train(base, "cpu", amp=False, jit=False)
    with t2j.env():
        amp, model = _train(base, "jax", amp=True, jit=False)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert amp[-1] < amp[0] - 0.3
    torch.testing.assert_close(amp, fp32, rtol=5e-3, atol=5e-3)


@pytest.mark.slow
def test_jit_training_under_autocast_matches_cpu_autocast():
    base = _tiny_gpt()
    cpu_amp, _ = _train(base, "cpu", amp=True, jit=False)
    with t2j.env():
        jit_amp, _ = _train(base, "jax", amp=True, jit=True)
    torch.testing.assert_close(jit_amp, cpu_amp, rtol=5e-3, atol=5e-3)


def test_jit_with_autocast_inside_and_decorator():
    a = _inputs()["a"]

    @t2j.amp.autocast()
    def f(x):
        return torch.softmax(x @ x.T, -1), x @ x.T

    with t2j.env():
        aj = a.to("jax")
        eager = f(aj)
        jitted = t2j.jit(f)
        got = jitted(aj)
        text = jitted.lower(aj).as_text()
    assert [t.dtype for t in got] == [t.dtype for t in eager] == [torch.float32, BF16]
    for g, e in zip(got, eager):
        torch.testing.assert_close(g.cpu(), e.cpu())
    assert "bf16" in text and "dot_general" in text


def test_jit_retraces_when_autocast_state_changes():
    a = _inputs()["a"]
    with t2j.env():
        f = t2j.jit(lambda x: x @ x.T)
        aj = a.to("jax")
        with t2j.amp.autocast():
            assert f(aj).dtype == BF16
        assert f(aj).dtype == torch.float32


def test_compile_forward_and_backward_under_autocast():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(6, 8)
    with torch.autocast("cpu", dtype=BF16):
        expected = model(x)
    expected.float().sum().backward()
    with t2j.env():
        mj = copy.deepcopy(model).to("jax")
        mj.zero_grad()
        with t2j.amp.autocast():
            got = t2j.compile(mj)(x.to("jax"))
        got.float().sum().backward()
    assert got.dtype == BF16
    torch.testing.assert_close(mj.fc1.weight.grad.cpu(), model.fc1.weight.grad, rtol=5e-2, atol=1e-2)


def test_hf_llama_forward_under_autocast_matches_cpu_autocast():
    # LlamaRotaryEmbedding turns autocast off for its own device type inside: nesting on "jax".
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        expected = model(ids).logits
    with t2j.env(), torch.no_grad(), torch.autocast("jax", dtype=BF16):
        got = copy.deepcopy(model).to("jax")(ids.to("jax")).logits
    assert got.dtype == expected.dtype == BF16
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=2e-2, atol=1e-2)


def test_autocast_inside_a_jax_jitted_functionalized_module():
    import jax
    import jax.numpy as jnp

    torch.manual_seed(0)
    lin, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    with torch.autocast("cpu", dtype=BF16):
        expected = lin(x)
    with t2j.env():
        fn, state = t2j.functionalize(copy.deepcopy(lin).to("jax"))

        def f(state, x):
            with t2j.amp.autocast():
                return fn(state, x)

        got = jax.jit(f)(state, jnp.asarray(x.numpy()))
    assert got.dtype == jnp.bfloat16
    torch.testing.assert_close(torch.tensor(got.astype(jnp.float32).tolist()), expected.detach().float(),
                               rtol=1e-2, atol=1e-2)
