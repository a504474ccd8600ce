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
import optax
import torch
import torch.utils._pytree as torch_pytree
from torch.nn.utils.stateless import _reparametrize_module

from .env import default_rng as _rng
from .interop import _jax_differentiated, _to_jax
from .tensor import Tensor, new_tensor


class TrainStep:
    """One compiled optax training step over a torch module (see `make_train_step`)."""

    def __init__(self, model: torch.nn.Module, loss_fn, optimizer: optax.GradientTransformation, remat=None,
                 donate: bool = True):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self._params = dict(model.named_parameters())
        self._trainable = [n for n, p in self._params.items() if p.requires_grad]
        self._buffers = dict(model.named_buffers())
        for name, t in [*self._params.items(), *self._buffers.items()]:
            if not isinstance(t, Tensor):
                raise TypeError(f"make_train_step: {name} is on {t.device}; move the module to the jax device first")
        self.opt_state = optimizer.init(self._read(self._trainable, self._params))
        self._remat = remat
        self._step = jax.jit(self._pure, donate_argnums=(0, 2) if donate else ())

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
            loss = self.loss_fn(self.model, *args, **kwargs)
        return loss._value(), {n: b._value() for n, b in buf.items()}

    def _pure(self, trainable, frozen, opt_state, buffers, key, batch):
        with _rng.traced_key(key) as rng:
            loss_fn = self._loss
            if self._remat is not None:
                policy = None if self._remat is True else self._remat
                loss_fn = jax.checkpoint(loss_fn, policy=policy, static_argnums=())
            (loss, new_buffers), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, buffers, batch)
            new_key = rng.key
        updates, opt_state = self.optimizer.update(grads, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), opt_state, new_buffers, new_key

    def __call__(self, *args, **kwargs):
        """Run one step on a batch (torch tensors or jax arrays); returns the loss as a tensor."""
        batch = torch_pytree.tree_map(lambda t: _to_jax(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        trainable = self._read(self._trainable, self._params)
        frozen = self._read([n for n in self._params if n not in self._trainable], self._params)
        buffers = self._read(list(self._buffers), self._buffers)
        with jax.enable_x64(True):
            loss, new_params, self.opt_state, new_buffers, _rng.key = self._step(
                trainable, frozen, self.opt_state, buffers, _rng.key, batch
            )
        for name, a in [*new_params.items(), *new_buffers.items()]:
            st = (self._params.get(name) if name in new_params else self._buffers[name])._t2j_storage
            st.array = a
            st.version += 1
        return new_tensor(loss)


def make_train_step(model: torch.nn.Module, loss_fn, optimizer: optax.GradientTransformation, *, remat=None,
                    donate: bool = True) -> TrainStep:
    """A jitted training step for ``model`` with an optax ``optimizer``.

    ``loss_fn(model, *batch)`` is torch code returning a scalar loss tensor;
    inside it, ``model`` holds the step's parameters: calling it, or reading them
    (a weight penalty over ``model.parameters()``), is differentiated.
    ``remat`` rematerializes the forward in the backward pass: ``True`` saves
    nothing, or pass a JAX checkpoint policy (``jax.checkpoint_policies.dots_saveable``).
    Parameters are read from and written back to ``model``; the optax state is
    ``step.opt_state``.

    >>> step = t2j.train.make_train_step(model, lambda m, x, y: F.mse_loss(m(x), y), optax.sgd(0.1))
    >>> loss = step(x, y)
    """
    return TrainStep(model, loss_fn, optimizer, remat=remat, donate=donate)
