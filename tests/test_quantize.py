"""t2j.quantize.int8_weight_only against torch's own int8 reference on the CPU."""

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2jax as t2j
from torch2jax.quantize import Int8Conv1D, Int8Linear, int8_weight_only, nbytes, quantize_per_channel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import amp_quantize  # noqa: E402


def _mlp(bias=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=bias), nn.ReLU(), nn.Linear(32, 8, bias=bias))


def _x():
    return torch.randn(5, 16, generator=torch.Generator().manual_seed(1))


def test_quantize_per_channel_is_symmetric_and_bounded():
    w = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    w[2] = 0.0
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (6,)
    assert q.abs().max() == 127 and s[2] == 1.0 and (q[2] == 0).all()
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()
    with t2j.env():
        qj, sj = quantize_per_channel(w.to("jax"))
    assert qj.device.type == "jax" and qj.dtype == torch.int8
    assert torch.equal(qj.cpu(), q) and torch.equal(sj.cpu(), s)
    qt, st = quantize_per_channel(w.T.contiguous(), dim=1)
    assert torch.equal(qt, q.T) and torch.equal(st, s)


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_equals_torch_dequantized_reference(bias):
    lin = _mlp(bias)[0]
    x = _x()
    q, s = quantize_per_channel(lin.weight)
    reference = F.linear(x, q.float() * s[:, None], lin.bias)
    packed = torch._weight_int8pack_mm(x, q, s) + (lin.bias if bias else 0)  # torch's int8 weight-only kernel
    with t2j.env():
        qlin = int8_weight_only(copy.deepcopy(lin).to("jax"))
        got = qlin(x.to("jax"))
    assert got.device.type == "jax" and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), reference.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cpu(), packed.detach(), rtol=1e-5, atol=1e-5)


def test_module_changed_in_place_and_state_dict_holds_int8():
    model = _mlp()
    fc = model[0]
    before = nbytes(model)
    assert int8_weight_only(model) is model
    assert model[0] is fc and isinstance(fc, Int8Linear) and isinstance(fc, nn.Linear)
    assert [n for n, _ in model.named_parameters()] == ["0.bias", "2.bias"]
    sd = model.state_dict()
    assert sd["0.weight"].dtype == torch.int8 and sd["0.weight"].shape == (32, 16)
    assert sd["0.weight_scale"].dtype == torch.float32 and sd["0.weight_scale"].shape == (32,)
    # int8 weights + float scales and biases, against float weights and biases
    assert nbytes(model) == (32 * 16 + 8 * 32) + 4 * (32 + 8) * 2
    assert before == 4 * (32 * 16 + 8 * 32 + 32 + 8)


def test_eager_jit_and_compile_on_jax_match_torch_cpu():
    x = _x()
    cpu = int8_weight_only(_mlp())
    expected = cpu(x)
    with t2j.env():
        model = int8_weight_only(_mlp().to("jax"))
        xj = x.to("jax")
        eager = model(xj)
        jitted = t2j.jit(lambda t: model(t))
        compiled = t2j.compile(model)
        outs = [eager, jitted(xj), compiled(xj)]
        text = jitted.lower(xj).as_text()
    for out in outs:
        torch.testing.assert_close(out.cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    # the int8 weights are the program's inputs: no float copy is stored or passed in
    assert "tensor<32x16xi8>" in text and "tensor<32x16xf32>, " not in text.split("{")[1].split(")")[0]


def test_gradients_reach_inputs_and_bias():
    x = _x()
    cpu = int8_weight_only(_mlp())
    xc = x.clone().requires_grad_()
    cpu(xc).square().sum().backward()
    with t2j.env():
        model = int8_weight_only(_mlp().to("jax"))
        xj = x.to("jax").requires_grad_()
        t2j.compile(model)(xj).square().sum().backward()
    torch.testing.assert_close(xj.grad.cpu(), xc.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[0].bias.grad.cpu(), cpu[0].bias.grad, rtol=1e-5, atol=1e-5)


def test_state_dict_round_trip_and_float_state_dict_refused():
    x = _x()
    with t2j.env():
        source = int8_weight_only(_mlp().to("jax"))
        torch.manual_seed(5)
        target = int8_weight_only(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to("jax"))
        target.load_state_dict(source.state_dict())
        torch.testing.assert_close(target(x.to("jax")).cpu(), source(x.to("jax")).cpu())
        with pytest.raises(TypeError, match=r"Int8Linear.load_state_dict: 0.weight is torch.float32, expected"):
            target.load_state_dict(_mlp().state_dict())


def test_autocast_gives_the_dtype_of_a_float_linear():
    x = _x()
    with t2j.env(), t2j.amp.autocast():
        float_out = _mlp().to("jax")(x.to("jax"))
        int8_out = int8_weight_only(_mlp().to("jax"))(x.to("jax"))
    assert int8_out.dtype == float_out.dtype == torch.bfloat16
    torch.testing.assert_close(int8_out.cpu().float(), float_out.cpu().float(), rtol=0.05, atol=0.05)


def test_filter_fn_selects_layers():
    model = int8_weight_only(_mlp(), filter_fn=lambda m, name: name == "2")
    assert type(model[0]) is nn.Linear and isinstance(model[2], Int8Linear)


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match=r"int8_weight_only: model must be a torch.nn.Module, got Tensor"):
        int8_weight_only(torch.ones(2))
    with pytest.raises(ValueError, match=r"int8_weight_only: Sequential has no nn.Linear to quantize"):
        int8_weight_only(nn.Sequential(nn.ReLU(), nn.Conv2d(1, 1, 1)))
    with pytest.raises(ValueError, match=r"no nn.Linear to quantize \(none found, all already quantized"):
        int8_weight_only(int8_weight_only(_mlp()))
    bad = _mlp()
    bad[2].weight = nn.Parameter(torch.ones(8, 32, dtype=torch.int32), requires_grad=False)
    with pytest.raises(TypeError, match=r"int8_weight_only: 2.weight must be a floating-point tensor, got torch.int32"):
        int8_weight_only(bad)
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"int8_weight_only: Linear.weight is on the meta device"):
        int8_weight_only(meta)
    with pytest.raises(TypeError, match=r"quantize_per_channel: weight must be a floating-point tensor, got torch.int64"):
        quantize_per_channel(torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"quantize_per_channel: weight must be 2-D, got shape \(2, 2, 2\)"):
        quantize_per_channel(torch.ones(2, 2, 2))


@pytest.mark.slow
def test_llama_logits_stay_close_and_memory_shrinks():
    r = amp_quantize.quantize_report(layers=2, hidden=64, vocab=256, batch=2, seq=16)
    assert r["ratio"] < 0.45
    assert r["max_diff_over_logit_std"] < 0.3 and r["top1_agreement"] > 0.85
    assert abs(r["ppl_got"] / r["ppl_ref"] - 1) < 0.01
    assert r["jit_vs_eager_max_diff"] < 1e-4


def test_hf_conv1d_equals_torch_dequantized_reference():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(12, 16)  # weight [in=16, out=12]
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    q, s = quantize_per_channel(conv.weight, dim=1)
    reference = x @ (q.float() * s[None, :]) + conv.bias
    with t2j.env():
        qconv = int8_weight_only(conv.to("jax"))
        got = qconv(x.to("jax"))
    assert isinstance(qconv, Int8Conv1D) and qconv.weight.shape == (16, 12) and qconv.weight_scale.shape == (12,)
    torch.testing.assert_close(got.cpu(), reference.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_gpt2_conv1d_quantized_and_tied_head_kept():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=1, n_head=2)).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        cpu = int8_weight_only(copy.deepcopy(model))
        cpu_logits = cpu(ids).logits
    attn = cpu.transformer.h[0].attn.c_attn
    assert isinstance(attn, Int8Conv1D) and attn.weight.dtype == torch.int8 and attn.weight_scale.shape == (192,)
    assert cpu.lm_head.weight.dtype == torch.float32 and cpu.lm_head.weight is cpu.transformer.wte.weight
    with t2j.env(), torch.no_grad():
        qj = int8_weight_only(copy.deepcopy(model).to("jax"))
        got = qj(ids.to("jax")).logits.cpu()
    torch.testing.assert_close(got, cpu_logits, rtol=1e-4, atol=1e-4)
    assert amp_quantize.compare_logits(ref, got, ids)["top1_agreement"] > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_int8pack_mm_lowering_matches_torch_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g).to(dtype)
    w = torch.randint(-127, 128, (12, 32), dtype=torch.int8, generator=g)
    s = (torch.rand(12, generator=g) / 100).to(dtype)
    expected = torch._weight_int8pack_mm(x, w, s)
    with t2j.env(fallback="error"):
        args = [t.to("jax") for t in (x, w, s)]
        got = torch._weight_int8pack_mm(*args)
        jitted = t2j.jit(torch._weight_int8pack_mm)(*args)
    assert got.dtype == jitted.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(jitted.cpu(), got.cpu())


def test_weight_int8pack_mm_bad_input_errors_like_torch():
    x, w, s = torch.randn(5, 32), torch.ones(12, 32, dtype=torch.int8), torch.ones(12)
    with t2j.env(fallback="error"):
        xj, wj, sj = (t.to("jax") for t in (x, w, s))
        with pytest.raises(RuntimeError, match=r"expected w to be int8, got torch.float32"):
            torch._weight_int8pack_mm(xj, wj.float(), sj)
        with pytest.raises(RuntimeError, match=r"expected w.size\(1\) \(16\) == x.size\(1\) \(32\)"):
            torch._weight_int8pack_mm(xj, wj[:, :16], sj)
        with pytest.raises(RuntimeError, match=r"expected x to be f32/f16/bf16, got torch.float64"):
            torch._weight_int8pack_mm(xj.double(), wj, sj)
        with pytest.raises(RuntimeError, match=r"_weight_int8pack_mm: expected scales to have x's dtype"):
            torch._weight_int8pack_mm(xj.bfloat16(), wj, sj)


_SCALED_MM_CASES = {
    "tensor-wise, float8 result": dict(scale_a=torch.tensor(0.3), scale_b=torch.tensor(1.7)),
    "row-wise, bias, bfloat16": dict(scale_a=torch.rand(16, 1) + 0.5, scale_b=torch.rand(1, 64) + 0.5,
                                     bias=torch.randn(64).bfloat16(), out_dtype=torch.bfloat16),
    "scale_result, saturating float8": dict(scale_a=torch.tensor([40.0]), scale_b=torch.tensor([[1.7]]),
                                            bias=torch.randn(64) * 30, scale_result=torch.tensor(3.0),
                                            out_dtype=torch.float8_e4m3fn),
    "scale_result ignored, float16": dict(scale_a=torch.tensor(0.3), scale_b=torch.tensor(1.7),
                                          scale_result=torch.tensor(3.0), out_dtype=torch.float16),
}


@pytest.mark.parametrize("case", list(_SCALED_MM_CASES))
def test_scaled_mm_float8_matches_torch_eagerly_and_in_one_program(case):
    torch.manual_seed(0)
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(64, 32).to(torch.float8_e5m2).t()
    kwargs = _SCALED_MM_CASES[case]
    expected = torch._scaled_mm(a, b, **kwargs)
    on_jax = {k: v.to("jax") for k, v in kwargs.items() if isinstance(v, torch.Tensor)} | \
        {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    eager = torch._scaled_mm(a.to("jax"), b.to("jax"), **on_jax)
    jitted = t2j.jit(lambda a, b: torch._scaled_mm(a, b, **on_jax), fullgraph=True)(a.to("jax"), b.to("jax"))
    for got in (eager, jitted):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=0, atol=0, equal_nan=True)


def test_scaled_mm_bad_scales_and_bias_raise_torchs_errors():
    a, b = torch.ones(4, 16).to(torch.float8_e4m3fn), torch.ones(8, 16).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device="jax")
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        torch._scaled_mm(a.to("jax"), b.to("jax"), torch.ones(4, device="jax"), one)
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        torch._scaled_mm(a.to("jax"), b.to("jax"), one.double(), one)
    with pytest.raises(RuntimeError, match="Bias must be size 8 but got 9"):
        torch._scaled_mm(a.to("jax"), b.to("jax"), one, one, bias=torch.ones(9, device="jax"))
