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


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "phi", "bert", "t5"])
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
