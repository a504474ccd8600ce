"""Train a small GPT written in plain PyTorch, compiled by torch2jax into one XLA program per step.

    python examples/train_gpt.py [--steps 600] [--layers 4] [--embd 128] [--batch 32] [--out runs/gpt]

The data is generated text (examples/gpt.py: sentences from a small grammar), so
nothing is downloaded. The training step — forward, backward and AdamW — is one
`t2j.jit` function: the model's parameters, their gradients and the optimizer's
state are carried in and out of the compiled program automatically. An LR
scheduler steps outside it without causing recompiles.

Writes ``<out>/loss.png`` (the loss curve) and ``<out>/checkpoint.pt`` (a torch
state dict), then samples text from the trained model.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

import gpt  # noqa: E402

import torch2jax as t2j  # noqa: E402


def progress(step, total, loss, tokens_per_s, width=30):
    done = int(width * step / total)
    bar = "#" * done + "-" * (width - done)
    end = "\n" if step == total else ""
    print(f"\r[{bar}] {step}/{total}  loss {loss:.3f}  {tokens_per_s:,.0f} tokens/s", end=end, flush=True)


def save_curve(losses, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("small GPT trained with torch2jax (t2j.jit)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default="runs/gpt")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    torch.manual_seed(0)
    data = gpt.CharData(gpt.make_text(20_000), args.block)
    cfg = gpt.GPTConfig(vocab_size=data.vocab_size, block_size=args.block, n_layer=args.layers,
                        n_head=args.heads, n_embd=args.embd, dropout=0.1)
    model = gpt.GPT(cfg).to("jax")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    print(f"GPT: {gpt.n_params(model) / 1e6:.2f}M parameters, vocab {cfg.vocab_size}, "
          f"{len(data.data):,} characters of training text")

    @t2j.jit
    def train_step(x, y):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    gen = torch.Generator().manual_seed(0)
    losses = []
    tokens = args.batch * args.block
    start = time.perf_counter()
    train_step(*(t.to("jax") for t in data.batch(args.batch, gen)))  # compile before timing
    print(f"compiled the training step in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = data.batch(args.batch, gen)
        loss = train_step(x.to("jax"), y.to("jax"))
        sched.step()
        if step % 10 == 0 or step == args.steps:
            losses_now = loss.item()
            rate = tokens * step / (time.perf_counter() - start)
            progress(step, args.steps, losses_now, rate)
        losses.append(loss)
    losses = [l.item() for l in losses]
    print(f"loss {losses[0]:.3f} -> {sum(losses[-20:]) / min(20, len(losses)):.3f} (mean of the last 20 steps); "
          f"{train_step.stats['traces']} traces, {train_step.stats['hits']} cached calls")

    save_curve(losses, os.path.join(args.out, "loss.png"))
    torch.save(model.state_dict(), os.path.join(args.out, "checkpoint.pt"))
    print(f"wrote {args.out}/loss.png and {args.out}/checkpoint.pt")

    model.eval()
    print("sample:", sample(model, data, "The ", new_tokens=200))


def sample(model, data, prompt, new_tokens, temperature=0.8):
    """Sample text. The forward pass is jitted on a fixed-size window (the model is
    causal, so positions after the last token do not change its logits), so every
    token reuses one compiled program."""
    block = model.cfg.block_size
    forward = t2j.jit(lambda window: model(window))
    ids = data.encode(prompt)[0].tolist()
    for _ in range(new_tokens):
        context = ids[-block:]
        window = torch.zeros(1, block, dtype=torch.long)
        window[0, :len(context)] = torch.tensor(context)
        logits = forward(window.to("jax"))[0, len(context) - 1] / temperature
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1)))
    return data.decode(ids)


if __name__ == "__main__":
    main()
