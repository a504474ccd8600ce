"""Mixed precision and int8 weights on the jax device.

1. AMP: a small GPT trained by `t2j.jit` under ``torch.autocast("jax", dtype=torch.bfloat16)``
   next to the same training in float32 (matmuls in bfloat16, softmax / norms / loss in float32).
2. Int8 weight-only quantization of a Hugging Face Llama (4 layers, d=256, random weights):
   parameter memory before / after and how far the logits move (the numbers in
   docs/amp_quantize.md and benchmarks/RESULTS.md come from this script).

    python examples/amp_quantize.py            # both parts
    python examples/amp_quantize.py --part quantize
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F

import torch2jax as t2j

sys.path.insert(0, os.path.dirname(__file__))
import gpt  # noqa: E402


def train_losses(model, x, y, *, amp: bool, steps: int) -> list:
    """AdamW steps of ``model`` (on the jax device) as one jitted program each."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    @t2j.jit
    def step(x, y):
        opt.zero_grad()
        with t2j.amp.autocast(torch.bfloat16, enabled=amp):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    return [step(x, y).item() for _ in range(steps)]


def amp_demo(steps: int = 20) -> None:
    torch.manual_seed(0)
    base = gpt.GPT(gpt.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64))
    idx = torch.randint(0, 64, (8, 33))
    with t2j.env():
        x, y = idx[:, :-1].to("jax"), idx[:, 1:].to("jax")
        fp32 = train_losses(copy.deepcopy(base).to("jax"), x, y, amp=False, steps=steps)
        bf16 = train_losses(copy.deepcopy(base).to("jax"), x, y, amp=True, steps=steps)
    print("step  float32  autocast(bf16)")
    for i in range(0, steps, max(1, steps // 5)):
        print(f"{i:4d}  {fp32[i]:.4f}   {bf16[i]:.4f}")
    print(f"last  {fp32[-1]:.4f}   {bf16[-1]:.4f}   (max |diff| {max(abs(a - b) for a, b in zip(fp32, bf16)):.4f})")


def tiny_llama(layers: int = 4, hidden: int = 256, vocab: int = 4096):
    """An HF Llama from a config, random weights (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def compare_logits(ref: torch.Tensor, got: torch.Tensor, ids: torch.Tensor) -> dict:
    """How far ``got`` logits are from ``ref``: max |diff| (absolute and over ref's std),
    top-1 agreement, perplexity of the next random token under each, KL(ref || got)."""
    ref, got = ref.float(), got.float()

    def ppl(logits):
        return torch.exp(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())).item()

    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean")
    diff = (got - ref).abs().max().item()
    return {
        "max_abs_logit_diff": diff,
        "max_diff_over_logit_std": diff / ref.std().item(),
        "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "ppl_ref": ppl(ref),
        "ppl_got": ppl(got),
        "kl_ref_got": kl.item() / ids.shape[1],
    }


def quantize_report(layers: int = 4, hidden: int = 256, vocab: int = 4096, batch: int = 4, seq: int = 128) -> dict:
    """Parameter bytes, compiled-forward memory and logit changes of
    `t2j.quantize.int8_weight_only` on a small Llama."""
    model = tiny_llama(layers, hidden, vocab)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    with t2j.env(), torch.no_grad():
        xj = ids.to("jax")
        float_model = copy.deepcopy(model).to("jax")
        qmodel = t2j.quantize.int8_weight_only(copy.deepcopy(model).to("jax"))
        ref = float_model(xj).logits.cpu()
        eager = qmodel(xj).logits.cpu()
        float_fwd = t2j.jit(lambda i: float_model(i).logits)
        int8_fwd = t2j.jit(lambda i: qmodel(i).logits)
        jitted = int8_fwd(xj).cpu()
        mem_float = float_fwd.lower(xj).compile().memory_analysis()
        mem_int8 = int8_fwd.lower(xj).compile().memory_analysis()
    linear_params = sum(m.weight.numel() for m in qmodel.modules() if isinstance(m, t2j.quantize.Int8Linear))
    return {
        "config": f"Llama {layers} layers, d={hidden}, vocab={vocab}, batch {batch}x{seq} random tokens",
        "bytes_float": t2j.quantize.nbytes(float_model),
        "bytes_int8": t2j.quantize.nbytes(qmodel),
        "ratio": t2j.quantize.nbytes(qmodel) / t2j.quantize.nbytes(float_model),
        "linear_weight_params": linear_params,
        "jit_args_float": mem_float.argument_size_in_bytes,
        "jit_args_int8": mem_int8.argument_size_in_bytes,
        "jit_temp_float": mem_float.temp_size_in_bytes,
        "jit_temp_int8": mem_int8.temp_size_in_bytes,
        **compare_logits(ref, eager, ids),
        "jit_vs_eager_max_diff": (jitted - eager).abs().max().item(),
    }


def print_report(r: dict) -> None:
    print(r["config"])
    print(f"parameter memory: {r['bytes_float'] / 2**20:.2f} MiB float32 -> {r['bytes_int8'] / 2**20:.2f} MiB "
          f"int8 weight-only ({r['ratio']:.2f}x; {r['linear_weight_params']:,} linear weights quantized)")
    print(f"logits: max |diff| {r['max_abs_logit_diff']:.4f} ({r['max_diff_over_logit_std']:.3f} of the logits' std), "
          f"top-1 agreement {r['top1_agreement']:.4f}, KL(float||int8) per token {r['kl_ref_got']:.2e}")
    mib = 2**20
    print(f"jitted forward (XLA memory analysis): arguments {r['jit_args_float'] / mib:.2f} -> "
          f"{r['jit_args_int8'] / mib:.2f} MiB, temporaries {r['jit_temp_float'] / mib:.2f} -> "
          f"{r['jit_temp_int8'] / mib:.2f} MiB")
    print(f"perplexity on random tokens: float {r['ppl_ref']:.2f}, int8 {r['ppl_got']:.2f}; "
          f"t2j.jit vs eager max |diff| {r['jit_vs_eager_max_diff']:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("amp", "quantize", "both"), default="both")
    args = parser.parse_args()
    if args.part in ("amp", "both"):
        amp_demo()
    if args.part in ("quantize", "both"):
        print_report(quantize_report())


if __name__ == "__main__":
    main()
