"""FlexAttention (torch.nn.attention.flex_attention) on jax tensors, against torch's CPU implementation."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import torch2jax as t2j


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _relative(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.1


def _sliding(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() < 20


_CASES = {
    "plain": {},
    "score_mod": {"score_mod": _relative},
    "causal_block_mask": {"mask": _causal},
    "both": {"score_mod": _relative, "mask": _sliding},
    "scale": {"scale": 0.3},
    "gqa": {"enable_gqa": True},
    "return_lse": {"return_aux": AuxRequest(lse=True)},
}


def _qkv(dtype=torch.float32, kv_heads=4):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 128, 16, generator=g, dtype=dtype), torch.randn(2, kv_heads, 128, 16, generator=g,
            dtype=dtype), torch.randn(2, kv_heads, 128, 16, generator=g, dtype=dtype))


def _call(q, k, v, device, mask=None, **kwargs):
    if mask is not None:
        kwargs["block_mask"] = create_block_mask(mask, None, None, q.size(2), k.size(2), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's, of flex_attention run without torch.compile)
        return flex_attention(q.to(device), k.to(device), v.to(device), **kwargs)


@pytest.mark.parametrize("name", sorted(_CASES))
def test_matches_torch_on_the_cpu(name):
    q, k, v = _qkv(kv_heads=2 if name == "gqa" else 4)
    expected, out = _call(q, k, v, "cpu", **_CASES[name]), _call(q, k, v, "jax", **_CASES[name])
    if name == "return_lse":
        (expected, aux), (out, out_aux) = expected, out
        torch.testing.assert_close(out_aux.lse.cpu(), aux.lse)
        assert out_aux.max_scores is None
    assert out.device.type == "jax"
    torch.testing.assert_close(out.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_dtypes_and_the_query_layout_follow_torch(dtype):
    q, k, v = _qkv(dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (the (B, S, H, D) layout models project to)
    expected, out = _call(q, k, v, "cpu", score_mod=_relative), _call(q, k, v, "jax", score_mod=_relative)
    assert out.dtype == expected.dtype and out.stride() == expected.stride()
    torch.testing.assert_close(out.cpu(), expected)


def test_gradients_reach_inputs_and_the_tensors_score_mod_reads():
    # torch's CPU FlexAttention has no backward: the reference is the same attention written out
    q, k, v = _qkv()
    bias = torch.randn(255)  # (a learned bias per relative position)

    def run(device):
        leaves = [t.clone().to(device).requires_grad_() for t in (q, k, v, bias)]
        qd, kd, vd, b = leaves
        if device == "jax":
            out = _call(qd, kd, vd, "jax", mask=_causal, score_mod=lambda s, bi, h, qi, ki: s + b[qi - ki + 127])
        else:
            relative = torch.arange(128)[:, None] - torch.arange(128)[None, :] + 127
            scores = qd @ kd.transpose(-2, -1) / math.sqrt(16) + b[relative]
            scores = scores.masked_fill(~torch.ones(128, 128, dtype=torch.bool).tril(), -math.inf)
            out = scores.softmax(-1) @ vd
        (out * torch.arange(16.0, device=device)).sum().backward()
        return [out.detach().cpu()] + [t.grad.cpu() for t in leaves]

    for got, expected in zip(run("jax"), run("cpu")):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_under_t2j_jit_and_torch_compile():
    q, k, v = _qkv()
    expected = _call(q, k, v, "cpu", score_mod=_relative)
    jitted = t2j.jit(lambda q, k, v: flex_attention(q, k, v, score_mod=_relative))
    torch.testing.assert_close(jitted(q.to("jax"), k.to("jax"), v.to("jax")).cpu(), expected)
    for backend in ("torch2jax", "aot_eager"):  # (another backend's graph break runs it eagerly)
        compiled = torch.compile(flex_attention, backend=backend)
        torch.testing.assert_close(compiled(q.to("jax"), k.to("jax"), v.to("jax"), score_mod=_relative).cpu(), expected)


def test_cpu_flex_attention_still_compiles_in_one_graph():
    q, k, v = _qkv()
    out = torch.compile(flex_attention, backend="aot_eager", fullgraph=True)(q, k, v, score_mod=_relative)
    torch.testing.assert_close(out, _call(q, k, v, "cpu", score_mod=_relative))


def test_bad_arguments_raise_torchs_errors():
    q, k, v = (t.to("jax") for t in _qkv(kv_heads=2))
    with pytest.raises(ValueError, match="same number of heads but got Hq=4 and Hkv=2. Try setting enable_gqa"):
        flex_attention(q, k, v)
    with pytest.raises(NotImplementedError, match="must be 4D tensors"):
        flex_attention(q[0], k[0], v[0], enable_gqa=True)
    mask = create_block_mask(_causal, None, None, 256, 256, device="jax")
    with pytest.raises(ValueError, match="block mask was created for a larger length"):
        flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


def test_block_masks_for_the_jax_device_are_built_uncompiled():
    # (transformers asks for _compile=True, which would have inductor generate code for the device)
    mask = create_block_mask(_causal, None, None, 128, 128, device="jax", _compile=True)
    assert mask.kv_num_blocks.device.type == "jax"
    assert mask.to_dense().cpu().equal(create_block_mask(_causal, None, None, 128, 128, device="cpu").to_dense())


@pytest.mark.slow  # (~15 s: the first eager run of every op of the model compiles it)
def test_hf_llama_with_flex_attention_matches_sdpa():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 64, (2, 16))
    model = transformers.LlamaForCausalLM(config)
    expected = model(ids, labels=ids).loss
    config._attn_implementation = "flex_attention"
    model = model.to("jax")
    loss = model(ids.to("jax"), labels=ids.to("jax")).loss
    loss.backward()
    torch.testing.assert_close(loss.cpu(), expected)
    assert model.model.embed_tokens.weight.grad is not None
