"""`t2j.compile(module)`: a module whose forward runs as a compiled JAX program.

The forward is a `t2j.jit` function of the module's call, so it has every property
of one: the state it reads and writes (buffers, the RNG key, parameters clipped in
the forward) is carried in and out; with gradients the call is one node of torch's
autograd graph whose backward is the JAX VJP of the program (recomputing the
forward, trading compute for memory), so ``loss.backward()`` on its output fills
``.grad`` of the module's parameters and of the inputs; tensor hooks and module
backward hooks registered inside the forward run (such a call runs eagerly), and
what the forward cannot trace (a value-dependent shape) runs eagerly with a warning.

Example::

    cm = t2j.compile(model)
    logits = cm(x)                   # compiled once per input shapes / static arguments
    loss_fn(logits, y).backward()
"""

from __future__ import annotations

import torch

from .jit import JitFunction


class CompiledModule(torch.nn.Module):
    """A module whose forward is compiled (see `compile`)."""

    def __init__(self, module: torch.nn.Module, fullgraph: bool = False):
        super().__init__()
        self.module = module
        self._forward = JitFunction(module.__call__, fullgraph=fullgraph)

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)


def compile(module: torch.nn.Module, *, fullgraph: bool = False) -> CompiledModule:  # noqa: A001 - torch.compile's
    """Wrap ``module`` so that its forward runs as a compiled program, cached per
    input shapes, dtypes and non-tensor arguments; gradients flow back to the
    module's parameters and the inputs (see this module's docstring).
    ``fullgraph=True`` raises where the forward cannot be one program, instead of
    running that call eagerly.

    >>> cm = t2j.compile(torch.nn.Linear(4, 2).to("jax"))
    >>> cm(torch.randn(3, 4, device="jax")).sum().backward()
    """
    return CompiledModule(module, fullgraph=fullgraph)
