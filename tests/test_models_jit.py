"""Real HF transformers models trained through t2j.jit (torch.optim) and optax, against torch CPU."""

from __future__ import annotations

import copy

import optax
import pytest
import torch

import torch2jax as t2j

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
V = 128


def _build(name):
    torch.manual_seed(0)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=V, num_key_value_heads=2, **small))
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=V, num_key_value_heads=2, **small))
    if name == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(vocab_size=V, num_key_value_heads=2, **small))
    if name == "gemma":
        return transformers.GemmaForCausalLM(transformers.GemmaConfig(
            vocab_size=V, num_key_value_heads=2, head_dim=16, **small))
    if name == "bart":
        return transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=V, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, dropout=0, attention_dropout=0,
            max_position_embeddings=64))
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=V, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **small))
    if name == "phi":
        return transformers.PhiForCausalLM(transformers.PhiConfig(
            vocab_size=V, resid_pdrop=0, embd_pdrop=0, attention_dropout=0, **small))
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=V, hidden_dropout_prob=0, attention_probs_dropout_prob=0, **small))
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=V, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, dropout_rate=0,
            decoder_start_token_id=0))
    raise ValueError(name)


# Mistral, Qwen2, Gemma and Phi are Llama-shaped decoders: slow set only (CI keeps one of each family)
_LLAMA_LIKE = {"mistral", "qwen2", "gemma", "phi"}
# slowest in CI, each with a sibling that stays (t5 for bart, llama for mixtral, roberta for bert)
_SLOW_JIT = _LLAMA_LIKE | {"bart", "mixtral", "bert"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_JIT else n
                                  for n in ["gpt2", "llama", "mistral", "qwen2", "gemma", "mixtral", "phi", "bert",
                                            "t5", "bart"]])
def test_jitted_training_matches_torch(name):
    ref = _build(name)
    model = copy.deepcopy(ref).to("jax")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    @t2j.jit
    def step(ids, labels):
        opt.zero_grad()
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        return out.loss, out.logits

    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, V, (2, 16), generator=g)
        loss, logits = step(ids, ids)
        ref_opt.zero_grad()
        expected = ref(input_ids=ids, labels=ids)
        expected.loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.cpu(), expected.loss.detach(), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(logits.cpu(), expected.logits.detach(), atol=2e-4, rtol=2e-4)
        losses.append(loss.item())
    # (parameters are compared through the losses: after Adam, a near-zero gradient's
    # update flips sign on rounding noise, so parameters are not compared directly)
    assert step.stats["traces"] == 2, t2j.explain_recompiles()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_optax_training_loss_decreases(name):
    model = _build(name).to("jax")
    step = t2j.train.make_train_step(model, lambda m, ids: m(input_ids=ids, labels=ids).loss, optax.adamw(3e-3))
    ids = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = [step(ids).item() for _ in range(15)]
    assert losses[-1] < losses[0] - 0.5, losses


class _CNN(torch.nn.Module):
    """ResNet-style: conv, BatchNorm, a residual block, pooling."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 4)

    def forward(self, x):
        F = torch.nn.functional
        h = F.relu(self.b1(self.c1(x)))
        h = h + F.relu(self.b2(self.c2(h)))
        return self.fc(self.pool(F.max_pool2d(h, 2)).flatten(1))


class _Seq(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        nn = torch.nn
        self.emb = nn.Embedding(20, 16)
        if kind == "transformer":
            layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
            self.body = nn.TransformerEncoder(layer, 2)
        else:
            self.body = getattr(nn, kind)(16, 16, batch_first=True, num_layers=2)
        self.kind = kind
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        h = self.body(self.emb(x))
        return self.fc(h.mean(1) if self.kind == "transformer" else h[0][:, -1])


@pytest.mark.parametrize("name", ["cnn", "LSTM", "GRU", "transformer"])
def test_plain_torch_models_jitted_training_matches_torch(name):
    torch.manual_seed(0)
    ref = _CNN() if name == "cnn" else _Seq(name)
    model = copy.deepcopy(ref).to("jax")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    F = torch.nn.functional

    @t2j.jit
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8, generator=g) if name == "cnn" else torch.randint(0, 20, (4, 6), generator=g)
        y = torch.randint(0, 4, (4,), generator=g)
        ref_opt.zero_grad()
        expected = F.cross_entropy(ref(x), y)
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(step(x, y).cpu(), expected.detach(), atol=2e-5, rtol=2e-5)
    for (n, b), r in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b.cpu(), r, atol=1e-5, rtol=1e-4, msg=n)


def test_transformer_with_a_causal_mask_argument_compiles_whole():
    # torch asks whether a given mask is causal (bool of a comparison): traced, the mask applies as given
    torch.manual_seed(0)
    ref = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0)
    model = copy.deepcopy(ref).to("jax")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def make_step(m, o):
        def step(src, tgt, mask):
            o.zero_grad()
            loss = m(src, tgt, src_mask=mask, tgt_mask=mask, tgt_is_causal=None).pow(2).mean()
            loss.backward()
            o.step()
            return loss

        return step

    step, ref_step = t2j.jit(make_step(model, opt), fullgraph=True), make_step(ref, ref_opt)
    g = torch.Generator().manual_seed(0)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    for _ in range(3):
        src, tgt = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
        torch.testing.assert_close(step(src.to("jax"), tgt.to("jax"), mask.to("jax")).cpu(),
                                   ref_step(src, tgt, mask).detach(), atol=2e-5, rtol=2e-5)
    assert step.stats["eager_calls"] == 0


def _encoder_or_multimodal(name, g):
    """(model, inputs, loss of outputs) for models without a built-in LM loss."""
    torch.manual_seed(0)
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if name == "roberta":
        model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(
            vocab_size=V, hidden_dropout_prob=0, attention_probs_dropout_prob=0, max_position_embeddings=64, **tiny))
        return model, dict(input_ids=torch.randint(3, V, (2, 16), generator=g))
    if name == "distilbert":
        model = transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
            vocab_size=V, dim=64, hidden_dim=128, n_layers=2, n_heads=4, dropout=0, attention_dropout=0))
        return model, dict(input_ids=torch.randint(0, V, (2, 16), generator=g))
    if name == "vit":
        model = transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=16, patch_size=4, num_labels=5, hidden_dropout_prob=0, attention_probs_dropout_prob=0, **tiny))
        return model, dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g))
    if name == "clip":
        model = transformers.CLIPModel(transformers.CLIPConfig(
            text_config=dict(vocab_size=V, max_position_embeddings=32, **tiny),
            vision_config=dict(image_size=16, patch_size=4, **tiny), projection_dim=32))
        return model, dict(input_ids=torch.randint(0, V, (2, 8), generator=g),
                           pixel_values=torch.randn(2, 3, 16, 16, generator=g))
    if name == "whisper":
        model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
            vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
            max_source_positions=16, max_target_positions=32, dropout=0, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=1))
        return model, dict(input_features=torch.randn(2, 16, 32, generator=g),
                           decoder_input_ids=torch.randint(3, V, (2, 8), generator=g))
    if name == "llava":  # its forward checks that the image tokens match the image features
        vision = dict(image_size=16, patch_size=4, **tiny)
        model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**vision), image_token_id=5,
            text_config=transformers.LlamaConfig(vocab_size=V, num_key_value_heads=2, **tiny)))
        ids = torch.randint(6, V, (2, 20), generator=g)
        ids[:, 2:18] = 5  # one token per patch
        return model, dict(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=g))
    raise ValueError(name)


def _score(out):
    logits = out.logits_per_image if hasattr(out, "logits_per_image") else out.logits
    return logits.pow(2).mean()


@pytest.mark.parametrize("name", [pytest.param("roberta", marks=pytest.mark.slow),
                                  pytest.param("distilbert", marks=pytest.mark.slow), "vit", "llava",
                                  pytest.param("clip", marks=pytest.mark.slow),
                                  pytest.param("whisper", marks=pytest.mark.slow)])
def test_encoders_and_multimodal_jitted_training_matches_torch(name):
    ref, _ = _encoder_or_multimodal(name, torch.Generator().manual_seed(0))
    model = copy.deepcopy(ref).to("jax")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    @t2j.jit
    def step(inputs):
        opt.zero_grad()
        loss = _score(model(**inputs))
        loss.backward()
        opt.step()
        return loss

    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        _, inputs = _encoder_or_multimodal(name, g)
        ref_opt.zero_grad()
        expected = _score(ref(**inputs))
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(step(inputs).cpu(), expected.detach(), atol=1e-5, rtol=5e-5)
    if name == "llava":
        assert step.stats["eager_calls"] == 0


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_jitted_decoding_step_updates_a_cache_it_closes_over(kind):
    """A decoding step that reads and updates a KV cache held outside it (cache -> its layers -> their
    key tensors): each call stores the new tensors in the cache as torch does. A StaticCache, whose
    length does not grow, compiles once."""
    ref = _build("llama").eval()
    model = copy.deepcopy(ref).to("jax")
    cfg = ref.config
    ids = torch.randint(0, V, (2, 5))

    def new_cache():
        return transformers.DynamicCache(config=cfg) if kind == "dynamic" else \
            transformers.StaticCache(config=cfg, max_cache_len=12)

    cache, expected_cache = new_cache(), new_cache()
    with torch.no_grad():
        model(ids.to("jax"), past_key_values=cache, cache_position=torch.arange(5, device="jax"))
        ref(ids, past_key_values=expected_cache, cache_position=torch.arange(5))

    @t2j.jit
    def step(tok, pos):
        with torch.no_grad():
            return model(tok, past_key_values=cache, cache_position=pos).logits[:, -1]

    tok = ids[:, -1:]
    for i in range(4):
        pos = torch.tensor([5 + i])
        got = step(tok.to("jax"), pos.to("jax"))
        with torch.no_grad():
            expected = ref(tok, past_key_values=expected_cache, cache_position=pos).logits[:, -1]
        torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
        tok = expected.argmax(-1, keepdim=True)
    for a, b in zip(cache.layers, expected_cache.layers):
        torch.testing.assert_close(a.keys.cpu(), b.keys)
        torch.testing.assert_close(a.values.cpu(), b.values)
    assert step.stats["compiles"] == (4 if kind == "dynamic" else 1)
    # a new prompt with a new cache: the program stores into the new one (the old one keeps its tensors)
    old_keys = cache.layers[0].keys.cpu()
    cache, expected_cache = new_cache(), new_cache()
    with torch.no_grad():
        model(ids.to("jax"), past_key_values=cache, cache_position=torch.arange(5, device="jax"))
        ref(ids, past_key_values=expected_cache, cache_position=torch.arange(5))
        torch.testing.assert_close(step(tok.to("jax"), torch.tensor([5], device="jax")).cpu(),
                                   ref(tok, past_key_values=expected_cache, cache_position=torch.tensor([5]))
                                   .logits[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.layers[0].keys.cpu(), expected_cache.layers[0].keys)
    assert old_keys.shape[-2] == (9 if kind == "dynamic" else 12)
