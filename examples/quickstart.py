"""Train a small classifier eagerly on the jax device with torch.optim.

    python examples/quickstart.py
"""

import torch
import torch.nn.functional as F

import torch2jax as t2j


def main():
    torch.manual_seed(0)
    with t2j.env():
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to("jax")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(64, 8, device="jax")
        y = (x[:, :4].argmax(dim=1)).to("jax")  # a learnable target
        for step in range(30):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if step % 10 == 0 or step == 29:
                print(f"step {step:2d}  loss {loss.item():.4f}")
        acc = (model(x).argmax(1) == y).float().mean()
        print(f"accuracy {acc.item():.2f}; the weights are a {type(model[0].weight.jax()).__name__}")
        print("ops and the path each took:", t2j.coverage(model, x))


if __name__ == "__main__":
    main()
