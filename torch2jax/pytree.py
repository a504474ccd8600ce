"""torch containers as JAX pytrees.

torch's named-tuple results (``torch.return_types.max``, ``sort``, ...) are
registered so results of multi-output ops flow through `jax.tree_util`,
`jax.jit` outputs and the interop helpers unchanged.
"""

from __future__ import annotations

import jax
import torch


def _register_return_types() -> None:
    for name in dir(torch.return_types):
        cls = getattr(torch.return_types, name)
        if not (isinstance(cls, type) and issubclass(cls, tuple)):
            continue
        try:
            jax.tree_util.register_pytree_node(cls, lambda t: (tuple(t), None), lambda _, children, c=cls: c(children))
        except ValueError:  # already registered
            pass


_register_return_types()
