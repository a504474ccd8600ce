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


_registered: set = set()


def ensure_jax_pytree(tree) -> None:
    """Register with JAX every torch pytree node type found in ``tree`` (HF
    ``ModelOutput`` classes, torch's named tuples...), using torch's own flatten and
    unflatten functions, so results of torch code can leave a jitted JAX function."""
    from torch.utils import _pytree as tp

    cls = type(tree)
    node = tp.SUPPORTED_NODES.get(cls)
    if node is None:
        return
    if cls not in _registered and cls not in (list, tuple, dict):
        _registered.add(cls)
        try:
            jax.tree_util.register_pytree_node(
                cls,
                lambda t, n=node: _children_and_context(n, t),
                lambda ctx, children, n=node: n.unflatten_fn(list(children), ctx),
            )
        except ValueError:  # JAX knows it already
            pass
    for child in node.flatten_fn(tree)[0]:
        ensure_jax_pytree(child)


def _children_and_context(node, tree):
    children, context = node.flatten_fn(tree)
    return list(children), context
