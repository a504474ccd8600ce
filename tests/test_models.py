"""Real models on the jax device in eager mode against torch CPU.

HF ``transformers`` models built from tiny configs (random weights, nothing downloaded) and
plain torch models (CNN with BatchNorm, LSTM, GRU, nn.TransformerEncoder). Each model is
built on CPU with a fixed seed and deep-copied to the jax device; both run the same inputs,
and the forward outputs and every parameter's gradient of one scalar loss must agree within
float32 tolerance. Greedy generation with a KV cache must agree token for token.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import torch2jax as t2j

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSpeechSeq2Seq,
    GPT2Config,
    GPT2LMHeadModel,
)

transformers.logging.set_verbosity_error()

VOCAB = 100
SEQ = 7
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
TINY_GQA = dict(TINY, num_key_value_heads=2)
ATTENTION = ("eager", "sdpa")


# -- comparison -----------------------------------------------------------------------


def _float_outputs(out):
    """The floating-point tensors of a model output (ModelOutput, tuple or tensor), by name."""
    if isinstance(out, torch.Tensor):
        return {"output": out}
    items = out.items() if hasattr(out, "items") else enumerate(out)
    return {str(k): v for k, v in items if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _assert_close(actual, expected, what, tol=1e-4):
    """float32 parity: error bounded by ``tol`` relative to the reference's scale."""
    expected = expected.detach()
    scale = max(expected.abs().max().item(), 1e-2) if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach().cpu(), expected, atol=tol * scale, rtol=tol,
                               msg=lambda m: f"{what}: {m}")


def _forward_backward(model, inputs, weights=None):
    """Outputs of ``model(**inputs)`` and the weights of the scalar loss, after its backward.

    The loss weighs every output element with a distinct random weight (a plain sum of
    softmax-like outputs would have zero gradient) and adds the model's own loss if any."""
    out = model(**inputs)
    outputs = _float_outputs(out)
    if weights is None:
        gen = torch.Generator().manual_seed(1)
        weights = [torch.randn(o.shape, generator=gen) for o in outputs.values()]
    loss = sum((o * w.to(o.device)).sum() for o, w in zip(outputs.values(), weights))
    if getattr(out, "loss", None) is not None:
        loss = loss + out.loss
    loss.backward()
    return outputs, weights


def _to_jax(x):
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().to("jax").requires_grad_(x.requires_grad)


def check_parity(model, inputs, tol=1e-4, buffers=False):
    """Forward outputs, all parameter gradients and the gradients of inputs that require
    them of ``model`` on jax match torch CPU (and its buffers, if ``buffers``), and no op of
    its forward or backward ran on the host."""
    jax_model = copy.deepcopy(model).to("jax")
    jax_inputs = {k: _to_jax(v) for k, v in inputs.items()}
    expected, weights = _forward_backward(model, inputs)
    actual = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # host fallbacks are asserted on below
        paths = t2j.coverage(lambda: actual.update(_forward_backward(jax_model, jax_inputs, weights)[0]))
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].device.type == "jax", name
        _assert_close(actual[name], expected[name], f"output {name}", tol)
    params = dict(jax_model.named_parameters())
    for name, p in model.named_parameters():
        q = params[name]
        assert (q.grad is None) == (p.grad is None), f"grad of {name}: {q.grad is None=} {p.grad is None=}"
        if p.grad is not None:
            _assert_close(q.grad, p.grad, f"grad of {name}", tol)
    for name, x in inputs.items():
        if isinstance(x, torch.Tensor) and x.requires_grad:
            _assert_close(jax_inputs[name].grad, x.grad, f"grad of input {name}", tol)
    if buffers:
        jax_buffers = dict(jax_model.named_buffers())
        for name, b in model.named_buffers():
            _assert_close(jax_buffers[name], b, f"buffer {name}", tol)
    assert [op for op, path in paths.items() if path == "fallback"] == [], "ops ran on the host"
    return jax_model


# -- HF transformers ------------------------------------------------------------------


def _gen():
    return torch.Generator().manual_seed(0)


def _ids(gen, batch=2, seq=SEQ):
    # Ids from 3 up: the tiny configs use 0-2 as special tokens.
    return torch.randint(3, VOCAB, (batch, seq), generator=gen)


def _causal_inputs():
    gen = _gen()
    ids = _ids(gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _encoder_inputs(token_types=False):
    def make():
        gen = _gen()
        ids = _ids(gen)
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0  # right padding in the second row
        inputs = dict(input_ids=ids, attention_mask=mask)
        if token_types:
            inputs["token_type_ids"] = (torch.arange(SEQ) >= 4).long().expand(2, SEQ)
        return inputs

    return make


def _seq2seq_inputs():
    gen = _gen()
    ids = _ids(gen)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=_ids(gen, seq=5), labels=_ids(gen, seq=5))


def _image(gen):
    return torch.randn(2, 3, 16, 16, generator=gen)


def _vit_inputs():
    return dict(pixel_values=_image(_gen()))


def _clip_inputs():
    gen = _gen()
    ids = _ids(gen)
    ids[:, -1] = 2  # eos: CLIP pools the text at the eos token
    return dict(input_ids=ids, pixel_values=_image(gen), attention_mask=torch.ones_like(ids))


def _whisper_inputs():
    gen = _gen()
    return dict(input_features=torch.randn(2, 8, 32, generator=gen), decoder_input_ids=_ids(gen, seq=5),
                labels=_ids(gen, seq=5))


_CAUSAL = (AutoModelForCausalLM, _causal_inputs)
HF_MODELS = {
    "gpt2": (dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64), *_CAUSAL),
    "llama": (TINY_GQA, *_CAUSAL),
    "mistral": (dict(TINY_GQA, sliding_window=4), *_CAUSAL),
    "qwen2": (TINY_GQA, *_CAUSAL),
    "gemma": (dict(TINY_GQA, head_dim=8), *_CAUSAL),
    "mixtral": (dict(TINY_GQA, num_local_experts=4, num_experts_per_tok=2), *_CAUSAL),
    "phi": (TINY, *_CAUSAL),
    "bert": (TINY, AutoModel, _encoder_inputs(token_types=True)),
    "roberta": (dict(TINY, pad_token_id=1), AutoModel, _encoder_inputs()),
    "distilbert": (dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64), AutoModel, _encoder_inputs()),
    "t5": (dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0),
           AutoModelForSeq2SeqLM, _seq2seq_inputs),
    "bart": (dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64),
             AutoModelForSeq2SeqLM, _seq2seq_inputs),
    "vit": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
                 patch_size=4), AutoModel, _vit_inputs),
    "clip": (dict(text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=16, eos_token_id=2),
                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     image_size=16, patch_size=4),
                  projection_dim=16), AutoModel, _clip_inputs),
    "whisper": (dict(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, decoder_start_token_id=1),
                AutoModelForSpeechSeq2Seq, _whisper_inputs),
}

_S2S = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            pad_token_id=1, decoder_start_token_id=2)
_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
            patch_size=4)

# More architectures, one attention implementation each: sliding windows and softcapping
# (Gemma 2/3), MoE (Qwen3-MoE), ALiBi (BLOOM), relative positions (DeBERTa-v2), CNNs
# (ConvNeXt, MobileNetV2, ResNet), windowed attention (Swin), weight norm and 1D
# convolutions (wav2vec2), a selective scan (Mamba).
EXTRA_HF_MODELS = {
    "gemma2": (dict(TINY_GQA, head_dim=8, sliding_window=4), *_CAUSAL),
    "gemma3_text": (dict(TINY_GQA, head_dim=8, sliding_window=4), *_CAUSAL),
    "qwen3": (dict(TINY_GQA, head_dim=8), *_CAUSAL),
    "qwen3_moe": (dict(TINY_GQA, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                  *_CAUSAL),
    "opt": (dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                 word_embed_proj_dim=32, max_position_embeddings=64), *_CAUSAL),
    "gpt_neox": (dict(TINY, max_position_embeddings=64), *_CAUSAL),
    "bloom": (dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4), *_CAUSAL),
    "falcon": (dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4), *_CAUSAL),
    "mamba": (dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4),
              AutoModelForCausalLM, _causal_inputs),
    "deberta-v2": (dict(TINY, max_position_embeddings=64, relative_attention=True, position_buckets=8,
                        pos_att_type=["p2c", "c2p"]), AutoModel, _encoder_inputs()),
    "convnext": (dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, patch_size=2, image_size=16), AutoModel,
                 _vit_inputs),
    "swin": (dict(image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2),
             AutoModel, _vit_inputs),
    "mobilenet_v2": (dict(image_size=16, depth_multiplier=0.25), AutoModel, _vit_inputs),
    "resnet": (dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"), AutoModel,
               _vit_inputs),
    "wav2vec2": (dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                      num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2),
                 AutoModel, lambda: dict(input_values=torch.randn(2, 400, generator=_gen()))),
    # encoders: factorized / shared embeddings (ALBERT, ELECTRA), bottlenecks (MobileBERT), DeBERTa v1
    "albert": (dict(TINY, embedding_size=16), AutoModel, _encoder_inputs(token_types=True)),
    "electra": (dict(TINY, embedding_size=16), AutoModel, _encoder_inputs()),
    "xlm-roberta": (dict(TINY, pad_token_id=1), AutoModel, _encoder_inputs()),
    "mobilebert": (dict(TINY, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
                        num_feedforward_networks=2), AutoModel, _encoder_inputs()),
    "deberta": (dict(TINY, max_position_embeddings=64, relative_attention=True, max_relative_positions=8,
                     pos_att_type=["p2c", "c2p"]), AutoModel, _encoder_inputs()),
    # decoders: partial rotary (GPT-J, CodeGen, Persimmon), multi-query attention (GPTBigCode), QK-norm
    # (OLMo 2), logit scaling (Cohere, Granite), fused QKV (Phi-3), sinusoidal positions (XGLM)
    "gptj": (dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64), *_CAUSAL),
    "codegen": (dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64),
                *_CAUSAL),
    "gpt_bigcode": (dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64), *_CAUSAL),
    "stablelm": (TINY_GQA, *_CAUSAL),
    "starcoder2": (TINY_GQA, *_CAUSAL),
    "phi3": (dict(TINY_GQA, pad_token_id=0), *_CAUSAL),
    "olmo": (TINY_GQA, *_CAUSAL),
    "olmo2": (TINY_GQA, *_CAUSAL),
    "cohere": (TINY_GQA, *_CAUSAL),
    "granite": (TINY_GQA, *_CAUSAL),
    "persimmon": (dict(TINY, max_position_embeddings=64), *_CAUSAL),
    "xglm": (dict(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                  max_position_embeddings=64), *_CAUSAL),
    # recurrences: RG-LRU (RecurrentGemma), SSD chunked scan (Mamba 2), Mamba + attention + MoE (Jamba)
    "recurrent_gemma": (dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, intermediate_size=64, lru_width=32, attention_window_size=4,
                             head_dim=8, block_types=["recurrent", "attention"]), *_CAUSAL),
    "mamba2": (dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4,
                    num_heads=8, head_dim=8, n_groups=1, chunk_size=4), *_CAUSAL),
    "jamba": (dict(TINY_GQA, num_experts=2, num_experts_per_tok=1, mamba_d_state=4, mamba_d_conv=4,
                   mamba_expand=2, mamba_dt_rank=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   expert_layer_offset=1, use_mamba_kernels=False), *_CAUSAL),
    # encoder-decoders: sinusoidal positions (Pegasus, Marian, M2M-100), pre-norm (mBART), local attention (LongT5)
    "pegasus": (_S2S, AutoModelForSeq2SeqLM, _seq2seq_inputs),
    "marian": (_S2S, AutoModelForSeq2SeqLM, _seq2seq_inputs),
    "mbart": (_S2S, AutoModelForSeq2SeqLM, _seq2seq_inputs),
    "m2m_100": (_S2S, AutoModelForSeq2SeqLM, _seq2seq_inputs),
    "longt5": (dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
                    local_radius=2), AutoModelForSeq2SeqLM, _seq2seq_inputs),
    # vision: relative position bias (BEiT), distillation token (DeiT), layer scale (DINOv2), efficient
    # attention with spatial reduction (SegFormer); speech (HuBERT); sigmoid-loss CLIP (SigLIP)
    "beit": (dict(_VIT, use_relative_position_bias=True), AutoModel, _vit_inputs),
    "deit": (_VIT, AutoModel, _vit_inputs),
    "dinov2": (dict(_VIT, mlp_ratio=2), AutoModel, _vit_inputs),
    "segformer": (dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                       num_attention_heads=[1, 2], patch_sizes=[3, 3], strides=[2, 2], mlp_ratios=[2, 2],
                       decoder_hidden_size=16), AutoModel, _vit_inputs),
    "hubert": (dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                    num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2),
               AutoModel, lambda: dict(input_values=torch.randn(2, 400, generator=_gen()))),
    "siglip": (dict(text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=16),
                    vision_config=dict(_VIT, intermediate_size=64)), AutoModel,
               lambda: dict(input_ids=_ids(_gen()), pixel_values=_image(_gen()))),
}

def build_hf(name, attention="eager", **kwargs):
    config_kwargs, auto, _ = HF_MODELS[name] if name in HF_MODELS else EXTRA_HF_MODELS[name]
    torch.manual_seed(0)
    config = AutoConfig.for_model(name, **config_kwargs)
    return auto.from_config(config, attn_implementation=attention, **kwargs).eval()


# sdpa is the default attention of every model here; the eager one of these runs in the
# slow set only, to keep the default run short.
SLOW_EAGER = {"roberta", "distilbert", "t5", "bart", "vit", "clip", "whisper"}
# the slowest sdpa cases in CI; their eager-attention siblings are in the slow set too, the jitted ones in CI
SLOW_SDPA = {"t5", "whisper", "vit"}
SLOW_EAGER_CI = {"gpt2"}  # gpt2-sdpa stays


@pytest.mark.parametrize("name, attention", [
    pytest.param(name, attention, id=f"{name}-{attention}",
                 marks=[pytest.mark.slow] if (attention == "eager" and name in SLOW_EAGER | SLOW_EAGER_CI)
                 or (attention == "sdpa" and name in SLOW_SDPA) else [])
    for name in HF_MODELS for attention in ATTENTION
])
def test_hf_model(name, attention):
    model = build_hf(name, attention)
    assert model.config._attn_implementation == attention
    check_parity(model, HF_MODELS[name][2]())


# a few cheap extras with a feature no default model has (multi-query attention, QK-norm)
DEFAULT_EXTRA = {"gpt_bigcode", "olmo2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT_EXTRA else [pytest.mark.slow])
                                  for n in EXTRA_HF_MODELS])
def test_hf_model_extra(name):
    check_parity(build_hf(name, "eager"), EXTRA_HF_MODELS[name][2]())


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow),
                                  pytest.param("llama", marks=pytest.mark.slow), "bert",
                                  pytest.param("t5", marks=pytest.mark.slow)])
def test_hf_bfloat16(name):
    """In bfloat16, the jax device is about as close to the float32 result as torch CPU is
    (it computes some ops in float32 where CPU rounds each step), outputs and gradients."""
    model = build_hf(name, "sdpa")
    inputs = HF_MODELS[name][2]()
    reference, weights = _forward_backward(model, inputs)
    half = copy.deepcopy(model).to(torch.bfloat16)
    jax_half = copy.deepcopy(half).to("jax")
    weights = [w.to(torch.bfloat16) for w in weights]
    cpu, _ = _forward_backward(half, inputs, weights)
    actual, _ = _forward_backward(jax_half, {k: _to_jax(v) for k, v in inputs.items()}, weights)

    def check(a, c, r, what):
        assert a.dtype == c.dtype, f"{what}: dtype {a.dtype}, torch CPU's {c.dtype}"
        scale = r.abs().max().item()
        error, cpu_error = (a.detach().cpu().float() - r).abs().max().item(), (c.float() - r).abs().max().item()
        assert error <= 2 * max(cpu_error, 8e-3 * scale), f"{what}: error {error:.3g}, torch CPU's {cpu_error:.3g}"

    for key in reference:
        check(actual[key], cpu[key], reference[key], f"output {key}")
    cpu_params, jax_params = dict(half.named_parameters()), dict(jax_half.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            check(jax_params[name].grad, cpu_params[name].grad, p.grad, f"grad of {name}")


class AllOutputs(nn.Module):
    """A model whose forward returns every attention map and hidden state as well."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        out = self.model(**inputs, output_attentions=True, output_hidden_states=True)
        return (out.last_hidden_state, *out.attentions, *out.hidden_states)


def test_hf_attentions_and_hidden_states():
    check_parity(AllOutputs(build_hf("bert", "eager")), HF_MODELS["bert"][2]())


@pytest.mark.slow
def test_hf_gradient_checkpointing():
    """Gradient checkpointing on the jax device runs as t2j.checkpoint (jax.checkpoint remat)."""
    model = build_hf("llama", "sdpa").train()  # checkpointing is active in training mode only; no dropout here
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    check_parity(model, _causal_inputs())


# grouped_mm is the default; the eager loop over experts compiles anew for every expert's
# token count.
@pytest.mark.parametrize("experts", [pytest.param("eager", marks=pytest.mark.slow), "grouped_mm",
                                     pytest.param("batched_mm", marks=pytest.mark.slow)])
def test_mixtral_experts(experts):
    model = build_hf("mixtral", "sdpa", experts_implementation=experts)
    assert model.config._experts_implementation == experts
    check_parity(model, _causal_inputs())


@pytest.mark.parametrize("shapes", [((10, 8), (3, 8, 8), [3, 3, 8]), ((3, 8, 8), (8, 16), [4, 8, 16]),
                                    ((8, 16), (16, 8), [4, 8, 12]), ((3, 4, 8), (3, 8, 8), None)],
                         ids=["2d_3d", "3d_2d", "2d_2d", "3d_3d"])
def test_grouped_mm(shapes):
    a_shape, b_shape, offs = shapes
    gen = _gen()
    a, b = torch.randn(a_shape, generator=gen), torch.randn(b_shape, generator=gen)
    offs = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    expected = torch._grouped_mm(a, b, offs=offs)
    actual = torch._grouped_mm(a.to("jax"), b.to("jax"), offs=_to_jax(offs))
    if len(a_shape) == 2 and len(b_shape) == 3:  # rows past offs[-1] are left uninitialized on CPU
        expected, actual = expected[: offs[-1]], actual[: offs[-1]]
    _assert_close(actual, expected, "_grouped_mm")


def test_grouped_mm_errors():
    a, b = torch.randn(10, 8, device="jax"), torch.randn(3, 8, 8, device="jax")
    offs = torch.tensor([3, 3, 8], dtype=torch.int32, device="jax")
    with pytest.raises(RuntimeError, match="offs must be a 1D int32 tensor"):
        torch._grouped_mm(a, b, offs=offs.long())
    with pytest.raises(RuntimeError, match="offs is required"):
        torch._grouped_mm(a, b)
    with pytest.raises(RuntimeError, match="bias is not supported"):
        torch._grouped_mm(a, b, offs=offs, bias=torch.zeros(3, 8, device="jax"))


@pytest.mark.parametrize("name, cache", [
    pytest.param("gpt2", "dynamic", marks=pytest.mark.slow), ("llama", "dynamic"),
    pytest.param("llama", "static", marks=pytest.mark.slow),
    pytest.param("t5", "dynamic", marks=pytest.mark.slow), pytest.param("whisper", "dynamic", marks=pytest.mark.slow),
])
def test_hf_generate_greedy(name, cache):
    """Greedy decoding with a KV cache, token for token (left padding for decoder-only)."""
    model = build_hf(name, "sdpa")
    model.generation_config.pad_token_id = 0
    inputs = HF_MODELS[name][2]()
    for key in ("labels", "decoder_input_ids"):
        inputs.pop(key, None)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=True, cache_implementation=cache)
    expected = model.generate(**inputs, **kwargs)
    jax_model = copy.deepcopy(model).to("jax")
    actual = jax_model.generate(**{k: v.to("jax") for k, v in inputs.items()}, **kwargs)
    assert actual.device.type == "jax"
    assert actual.shape == expected.shape
    assert actual.cpu().tolist() == expected.tolist()


@pytest.mark.slow
def test_hf_generate_beam_search():
    """Beam search reorders the KV cache by beam every step (index_select on the cache)."""
    model = build_hf("gpt2", "sdpa")
    model.generation_config.pad_token_id = 0
    inputs = _causal_inputs()
    del inputs["labels"]
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, num_beams=3, do_sample=False)
    expected = model.generate(**inputs, **kwargs)
    actual = copy.deepcopy(model).to("jax").generate(**{k: v.to("jax") for k, v in inputs.items()}, **kwargs)
    assert actual.cpu().tolist() == expected.tolist()


# -- plain torch models ---------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.layers = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        h = self.layers(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class Recurrent(nn.Module):
    def __init__(self, cell, bidirectional):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = cell(16, 24, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(24 * (2 if bidirectional else 1), VOCAB)

    def forward(self, input_ids):
        out, _ = self.rnn(self.embed(input_ids))
        return self.head(out)


class Encoder(nn.Module):
    def __init__(self, norm_first):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids, padding_mask=None, causal=False):
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1], device=input_ids.device) if causal \
            else None
        h = self.encoder(self.embed(input_ids), mask=mask, src_key_padding_mask=padding_mask, is_causal=causal)
        return self.head(h)


def _resnet_input():
    return dict(x=torch.randn(4, 3, 16, 16, generator=_gen()))


@pytest.mark.parametrize("train, channels_last", [(True, False), (False, False),
                                                  pytest.param(True, True, marks=pytest.mark.slow)],
                         ids=["train", "eval", "train_channels_last"])
def test_resnet_batchnorm(train, channels_last):
    torch.manual_seed(0)
    model = ResNet()
    # Non-trivial running statistics, so eval mode does not normalize by (0, 1).
    with torch.no_grad():
        model.train()(torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(2)))
    inputs = _resnet_input()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        inputs["x"] = inputs["x"].to(memory_format=torch.channels_last)
    check_parity(model.train(train), inputs, buffers=True)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN], ids=["lstm", "gru", "rnn"])
def test_recurrent(cell, bidirectional):
    torch.manual_seed(0)
    check_parity(Recurrent(cell, bidirectional).eval(), dict(input_ids=_ids(_gen())))


class PackedRecurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = cell(16, 24, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, VOCAB)

    def forward(self, input_ids, lengths):
        packed = pack_padded_sequence(self.embed(input_ids), lengths, batch_first=True, enforce_sorted=False)
        out, state = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=input_ids.shape[1])
        return self.head(out), state[0] if isinstance(state, tuple) else state


# Every time step of a packed batch has its own batch size, so its own compilations.
@pytest.mark.slow
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_recurrent_packed(cell):
    torch.manual_seed(0)
    inputs = dict(input_ids=_ids(_gen(), batch=3), lengths=torch.tensor([SEQ, 3, 5]))
    check_parity(PackedRecurrent(cell).eval(), inputs)


def test_pack_padded_sequence_errors():
    x = torch.randn(3, 5, 2, device="jax")
    with pytest.raises(RuntimeError, match="sorted in decreasing order"):
        pack_padded_sequence(x, [2, 3, 1], batch_first=True)
    with pytest.raises(RuntimeError, match="greater than 0"):
        pack_padded_sequence(x, [5, 0, 0], batch_first=True)
    with pytest.raises(RuntimeError, match="exceeds the sequence length"):
        pack_padded_sequence(x, [6, 2, 1], batch_first=True)


class Cells(nn.Module):
    """Step-by-step nn.LSTMCell and nn.GRUCell from given initial states, and an LSTM with
    projections: the fused cells with and without bias, batched and unbatched."""

    def __init__(self):
        super().__init__()
        self.lstm_cell = nn.LSTMCell(8, 12)
        self.gru_cell = nn.GRUCell(12, 6, bias=False)
        self.lstm = nn.LSTM(6, 10, proj_size=4, batch_first=True)

    def forward(self, x, h, c):
        outs = []
        g = h[:, :6]
        for t in range(x.shape[1]):
            h, c = self.lstm_cell(x[:, t], (h, c))
            g = self.gru_cell(h, g)
            outs.append(g)
        out, (hn, cn) = self.lstm(torch.stack(outs, 1))
        unbatched = self.gru_cell(h[0], g[0])
        return out, hn, cn, unbatched


@pytest.mark.slow  # ~20 s; test_recurrent covers the same cells inside nn.RNN / LSTM / GRU in CI
def test_recurrent_cells():
    torch.manual_seed(0)
    gen = _gen()
    x, h, c = torch.randn(3, 5, 8, generator=gen), torch.randn(3, 12, generator=gen), torch.randn(3, 12, generator=gen)
    check_parity(Cells(), dict(x=x.requires_grad_(), h=h.requires_grad_(), c=c.requires_grad_()))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("masks", ["none", "padding", "causal"])
def test_transformer_encoder(masks, norm_first):
    torch.manual_seed(0)
    inputs = dict(input_ids=_ids(_gen()))
    if masks == "padding":
        inputs["padding_mask"] = torch.zeros(2, SEQ, dtype=torch.bool)
        inputs["padding_mask"][1, -3:] = True
    if masks == "causal":
        inputs["causal"] = True
    check_parity(Encoder(norm_first).eval(), inputs)


def check_inference(model, inputs, fused_op):
    """Under no_grad, ``model`` on jax matches torch CPU, runs nothing on the host, and
    reaches ``fused_op`` (the modules' inference fast path)."""
    jax_model = copy.deepcopy(model).to("jax")
    with torch.no_grad():
        expected = _float_outputs(model(**inputs))
        actual = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            paths = t2j.coverage(lambda: actual.update(_float_outputs(jax_model(**{k: _to_jax(v) for k, v in
                                                                                  inputs.items()}))))
    assert actual.keys() == expected.keys()
    for name in expected:
        _assert_close(actual[name], expected[name], f"output {name}")
    assert str(fused_op) in paths, "the fast path was not taken"
    assert [op for op, path in paths.items() if path == "fallback"] == [], "ops ran on the host"


def _padding_inputs():
    inputs = dict(input_ids=_ids(_gen()), padding_mask=torch.zeros(2, SEQ, dtype=torch.bool))
    inputs["padding_mask"][1, -3:] = True
    return inputs


@pytest.mark.parametrize("masks", ["none", "padding", "causal"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_transformer_encoder_fast_path(norm_first, masks):
    torch.manual_seed(0)
    inputs = _padding_inputs() if masks == "padding" else dict(input_ids=_ids(_gen()), causal=masks == "causal")
    check_inference(Encoder(norm_first).eval(), inputs, torch.ops.aten._transformer_encoder_layer_fwd.default)


def test_transformer_encoder_nested_fast_path():
    torch.manual_seed(0)
    model = Encoder(False).eval()
    model.encoder = nn.TransformerEncoder(model.encoder.layers[0], 2)  # enable_nested_tensor=True
    check_inference(model, _padding_inputs(), torch.ops.aten._transformer_encoder_layer_fwd.default)


@pytest.mark.parametrize("average", [True, False], ids=["average", "per_head"])
def test_multihead_attention_fast_path(average):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x, mask):
            return self.mha(x, x, x, key_padding_mask=mask, average_attn_weights=average)

    mask = torch.zeros(2, SEQ, dtype=torch.bool)
    mask[0, -2:] = True
    x = torch.randn(2, SEQ, 32, generator=_gen())
    check_inference(SelfAttention(), dict(x=x, mask=mask), torch.ops.aten._native_multi_head_attention.default)


def test_multihead_attention_weights():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, kdim=24, vdim=16, batch_first=True).eval()
    gen = _gen()
    q, k, v = (torch.randn(2, n, d, generator=gen) for n, d in [(5, 32), (SEQ, 24), (SEQ, 16)])
    mask = torch.zeros(2, SEQ, dtype=torch.bool)
    mask[0, -2:] = True

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, q, k, v, mask):
            return self.mha(q, k, v, key_padding_mask=mask, need_weights=True, average_attn_weights=False)

    check_parity(Wrapper(), dict(q=q, k=k, v=v, mask=mask))


def test_save_pretrained_from_the_jax_device_round_trips(tmp_path):
    """transformers' save_pretrained (safetensors) finds tied weights by their storages'
    data_ptr: a jax-device model saves once per storage and loads back on the CPU."""
    from safetensors.torch import save_file

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to("jax").eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert model.lm_head.weight.data_ptr() != model.transformer.wpe.weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value.cpu(), rtol=0, atol=0)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(model(ids.to("jax")).logits.cpu(), loaded(ids).logits)
    # safetensors refuses tensors that share memory, on any device
    x = torch.arange(4.0, device="jax")
    with pytest.raises(RuntimeError, match="share memory"):
        save_file({"a": x, "b": x[1:]}, tmp_path / "shared.safetensors")


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("left_aligned", [True, False])
def test_transformer_encoder_nested_path_with_final_norm_eager_and_jit(batch_first, left_aligned):
    """The default encoder (enable_nested_tensor=True) in eval without grad: torch zeroes
    the padded positions before the final norm when the mask is left-aligned, not otherwise."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
    encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8)).eval()
    x = torch.randn(3, 5, 8) if batch_first else torch.randn(5, 3, 8)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    if not left_aligned:
        pad[0, 1] = True
    with torch.no_grad():
        expected = encoder(x, src_key_padding_mask=pad)
        encoder.to("jax")
        eager = encoder(x.to("jax"), src_key_padding_mask=pad.to("jax"))
        jitted = t2j.jit(lambda a, m: encoder(a, src_key_padding_mask=m))(x.to("jax"), pad.to("jax"))
    for out in (eager, jitted):
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_transformer_encoder_nested_path_with_a_number_input_under_jit():
    """A float argument that changes is a program input (a traced number); the encoder still
    takes torch's nested-tensor path, which zeroes the padded positions."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8)).eval()
    x = torch.randn(3, 5, 8)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    run = t2j.jit(lambda a, m, s: encoder(a * s, src_key_padding_mask=m))
    with torch.no_grad():
        expected = [encoder(x * s, src_key_padding_mask=pad) for s in (1.0, 2.0, 3.0)]
        encoder.to("jax")
        got = [run(x.to("jax"), pad.to("jax"), s) for s in (1.0, 2.0, 3.0)]
    for out, want in zip(got, expected):
        torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)
    assert run.stats["traces"] == 2
