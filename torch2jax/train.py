"""Training a torch module with an optax optimizer, in one jitted step.

The torch module supplies the model and the loss (torch code); JAX supplies the
gradients (`jax.value_and_grad` of the functionalized module) and optax the
update. Parameters stay in the module: each step reads them from its tensors
and writes the new values back, so the module can be evaluated, saved or
trained further in torch at any time.

Example::

    step = t2j.train.make_train_step(model, lambda m, x, y: F.cross_entropy(m(x), y), optax.adamw(1e-3))
    for x, y in batches:
        loss = step(x, y)
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import torch
import torch.utils._pytree as torch_pytree
from torch.nn.utils.stateless import _reparametrize_module

from .env import default_rng as _rng
from .interop import _jax_differentiated, _to_jax, jax_view, torch_view
from .tensor import Tensor, new_tensor


class TrainStep:
    """One compiled optax training step over a torch module (see `make_train_step`)."""

    def __init__(self, model: torch.nn.Module, loss_fn, optimizer: optax.GradientTransformation, remat=None,
                 donate: bool = True, has_aux: bool = False):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self._has_aux = has_aux
        self._params = dict(model.named_parameters())
        self._trainable = [n for n, p in self._params.items() if p.requires_grad]
        self._buffers = dict(model.named_buffers())
        for name, t in [*self._params.items(), *self._buffers.items()]:
            if not isinstance(t, Tensor):
                raise TypeError(f"make_train_step: {name} is on {t.device}; move the module to the jax device first")
        self.opt_state = optimizer.init(self._read(self._trainable, self._params))
        self._remat = remat
        # (the batch's Python values other than floats are static, as in t2j.jit: `_split_batch`)
        self._step = jax.jit(self._pure, donate_argnums=(0, 2) if donate else (), static_argnums=(6,))

    @staticmethod
    def _read(names, tensors):
        return {n: tensors[n]._value() for n in names}

    def _loss(self, trainable, frozen, buffers, batch):
        tensors = {n: new_tensor(a) for n, a in {**trainable, **frozen}.items()}
        buf = {n: new_tensor(a) for n, a in buffers.items()}
        args, kwargs = torch_pytree.tree_map(lambda a: new_tensor(a) if isinstance(a, jax.Array | jax.core.Tracer) else a,
                                             batch)
        # the whole loss sees the step's tensors in the module, not only its forward: a penalty over
        # ``m.parameters()`` or a term reading ``m.head.weight`` is differentiated too
        with _jax_differentiated(), _reparametrize_module(self.model, {**tensors, **buf}, tie_weights=True):
            loss, aux = self._loss_and_aux(self.loss_fn(self.model, *args, **kwargs))
            aux = jax_view(aux)
        return loss, ({n: b._value() for n, b in buf.items()}, aux)

    def _loss_and_aux(self, out):
        """What ``loss_fn`` returned, checked: the loss as the 0-d array JAX differentiates, and the
        aux (None without ``has_aux``)."""
        if self._has_aux and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"make_train_step(has_aux=True): loss_fn must return a pair (loss, aux), got "
                            f"{type(out).__name__}")
        loss, aux = out if self._has_aux else (out, None)
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            got = f"a {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__
            pair = "; for (loss, aux) pass has_aux=True" if isinstance(out, tuple) and not self._has_aux else ""
            raise TypeError(f"make_train_step: loss_fn must return a floating-point scalar loss tensor computed from "
                            f"the model, got {got}{pair}")
        if loss.numel() != 1:  # (torch's backward() takes a one-element loss of any shape too)
            raise ValueError(f"make_train_step: loss_fn must return a scalar loss tensor, got one of shape "
                             f"{tuple(loss.shape)}; reduce it (.mean(), .sum())")
        return _to_jax(loss).reshape(()), aux

    def _pure(self, trainable, frozen, opt_state, buffers, key, arrays, layout):
        batch = _join_batch(arrays, layout)
        with _rng.traced_key(key) as rng:
            loss_fn = self._loss
            if self._remat is not None:
                policy = None if self._remat is True else self._remat
                loss_fn = jax.checkpoint(loss_fn, policy=policy, static_argnums=())
            (loss, (new_buffers, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable, frozen, buffers, batch)
            new_key = rng.key
        updates, opt_state = self.optimizer.update(grads, opt_state, trainable)
        return loss, aux, optax.apply_updates(trainable, updates), opt_state, new_buffers, new_key

    def __call__(self, *args, **kwargs):
        """Run one step on a batch (torch tensors or jax arrays); returns the loss as a tensor
        (with ``has_aux``, the pair ``(loss, aux)``, aux's tensors and numbers as tensors)."""
        batch = torch_pytree.tree_map(lambda t: _to_jax(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        trainable = self._read(self._trainable, self._params)
        frozen = self._read([n for n in self._params if n not in self._trainable], self._params)
        buffers = self._read(list(self._buffers), self._buffers)
        with jax.enable_x64(True):
            loss, aux, new_params, self.opt_state, new_buffers, _rng.key = self._step(
                trainable, frozen, self.opt_state, buffers, _rng.key, *_split_batch(batch)
            )
        for name, a in [*new_params.items(), *new_buffers.items()]:
            st = (self._params.get(name) if name in new_params else self._buffers[name])._t2j_storage
            st.array = a
            st.version += 1
        return (new_tensor(loss), torch_view(aux)) if self._has_aux else new_tensor(loss)


def _traced(leaf) -> bool:
    """Whether a batch leaf is an input of the step's program: arrays and floats. Other Python values
    (ints, bools, strings: sizes, flags, modes the loss branches on) are static, as in t2j.jit."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, float, complex))


def _split_batch(batch):
    """The batch as the step's program takes it: its traced leaves, and a static (hashable) layout
    of the rest, its structure and its other values by position (`_join_batch` rebuilds it)."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    static = tuple((i, leaf) for i, leaf in enumerate(leaves) if not _traced(leaf))
    return [leaf for leaf in leaves if _traced(leaf)], (treedef, static)


def _join_batch(arrays, layout):
    """The batch `_split_batch` split into ``arrays`` and ``layout``."""
    treedef, static = layout
    leaves = list(arrays)
    for i, value in static:  # (by increasing position: each goes back where it was)
        leaves.insert(i, value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def make_train_step(model: torch.nn.Module, loss_fn, optimizer: optax.GradientTransformation, *, remat=None,
                    donate: bool = True, has_aux: bool = False) -> TrainStep:
    """A jitted training step for ``model`` with an optax ``optimizer``.

    ``loss_fn(model, *batch)`` is torch code returning a scalar loss tensor
    (with ``has_aux=True``, a pair ``(loss, aux)``: aux, tensors or numbers such as
    metrics, is returned by the step after the loss, not differentiated);
    inside it, ``model`` holds the step's parameters: calling it, or reading them
    (a weight penalty over ``model.parameters()``), is differentiated. Python ints,
    bools and strings in the batch are static, as in `t2j.jit`: a new value compiles
    the step again; floats are traced.
    ``remat`` rematerializes the forward in the backward pass: ``True`` saves
    nothing, or pass a JAX checkpoint policy (``jax.checkpoint_policies.dots_saveable``).
    Parameters are read from and written back to ``model``; the optax state is
    ``step.opt_state``.

    >>> step = t2j.train.make_train_step(model, lambda m, x, y: F.mse_loss(m(x), y), optax.sgd(0.1))
    >>> loss = step(x, y)
    """
    return TrainStep(model, loss_fn, optimizer, remat=remat, donate=donate, has_aux=has_aux)
