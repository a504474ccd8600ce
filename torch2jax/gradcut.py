"""torch's autograd graph cuts, kept when JAX differentiates torch code.

When JAX differentiates a traced torch program (the outputs of a `t2j.jit`
function or of `t2j.compile` going into ``loss.backward()``, `functionalize`
under `jax.grad`, `call_torch`), it follows the data. torch follows its
autograd graph, which the data does not show: a value computed under
``torch.no_grad()`` or read through ``detach()`` carries no gradient, and a write made with grad mode off (weight clipping, an optimizer
step) leaves the tensor where it was in the graph: later reads send their
gradient to the tensor as it was before the write.

While JAX traces (never in eager mode, where JAX does not differentiate), the
dispatcher marks the cuts in the program:

* an op run with grad mode off returns `stop` (`jax.lax.stop_gradient`) values,
  and its views read through ``tensor.DETACHED``;
* ``detach()`` is a view through ``tensor.DETACHED``, which stops the gradient on
  read (``.data`` is not: torch makes it as it makes the tensors autograd saves,
  which differentiate again under ``create_graph``);
* a write with grad mode off, or through a detached view, is `straight_through`:
  the new value with the old value's tangent.

A custom `torch.autograd.Function` runs its forward with grad mode off; its
forward is not cut, so JAX differentiates the ops it runs.

Example::

    def loss(w, x):
        with torch.no_grad():
            scale = x.abs().max()       # a constant for the gradient, as in torch
        return ((w * x) / scale).sum()

    jax.grad(t2j.jax_view(loss))(w, x)  # d/dw only through w * x
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import torch
from jax._src import core as _jax_core
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax.extend.core import Primitive

_TRACE = _jax_core.trace_state_strong_ref
_EvalTrace = _jax_core.EvalTrace
_grad_enabled = torch.is_grad_enabled


class _State(threading.local):
    functions = 0  # how many autograd.Function.apply calls are running on this thread


_state = _State()


def cutting() -> bool:
    """Whether an op running now must cut its results: JAX is tracing and grad mode
    is off, and no autograd.Function's forward (which turns grad mode off) is running."""
    return not _grad_enabled() and not isinstance(_TRACE.value, _EvalTrace) and not _state.functions


def differentiable(a) -> bool:
    """Whether JAX may differentiate array ``a``: it is traced and floating."""
    return isinstance(a, jax.core.Tracer) and jnp.issubdtype(a.dtype, jnp.inexact)


_ADInplaceOrView = torch._C.DispatchKey.ADInplaceOrView
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded


def user_detach(array) -> bool:
    """Whether a ``detach`` of a tensor holding ``array`` cuts the gradient: JAX traces a
    floating value, and the user called ``detach()``. autograd detaches too, to save an
    output for backward and to unpack it (differentiable again under ``create_graph``),
    and for ``.data``; it calls the op directly, where ``detach()`` comes through
    autograd's kernel, which excludes the ADInplaceOrView key below it."""
    return differentiable(array) and _excluded(_ADInplaceOrView)


def stop(a):
    """``a`` with no gradient, where it is a traced floating array (positions and
    integers are returned as they are)."""
    return jax.lax.stop_gradient(a) if differentiable(a) else a


# ---------------------------------------------------------------------------
# straight_through: a write that keeps the tensor's place in the graph
# ---------------------------------------------------------------------------

straight_through_p = Primitive("t2j_straight_through")
straight_through_p.def_impl(lambda old, new: new)
straight_through_p.def_abstract_eval(lambda old, new: new)
_mlir.register_lowering(straight_through_p, lambda ctx, old, new: [new])


def _straight_through_jvp(primals, tangents):
    old, new = primals
    out = straight_through_p.bind(old, new)
    t_old = tangents[0]
    if type(t_old) is _ad.Zero:
        return out, _ad.Zero.from_primal_value(out)
    return out, t_old


def _straight_through_batch(args, dims):
    size = next(a.shape[d] for a, d in zip(args, dims) if isinstance(d, int))
    args = [jnp.moveaxis(a, d, 0) if isinstance(d, int) else jnp.broadcast_to(a, (size, *a.shape))
            for a, d in zip(args, dims)]
    return straight_through_p.bind(*args), 0


_ad.primitive_jvps[straight_through_p] = _straight_through_jvp
_batching.primitive_batchers[straight_through_p] = _straight_through_batch


def straight_through(old, new):
    """``new``, differentiated as ``old``: a storage's value after a write that torch's
    autograd does not record, whose later reads send their gradient to the tensor as
    it was (its leaf, or the op that made it).

    >>> jax.grad(lambda w: (straight_through(w, jnp.clip(w, -1, 1)) * 3).sum())(w)  # 3 everywhere
    """
    return straight_through_p.bind(old, new)


def written(old, new, detached: bool):
    """The storage array ``new`` replacing ``old`` in a write: `straight_through` where
    autograd does not record the write (grad mode off, or through a ``detached`` view)
    and JAX traces a floating value; ``new`` otherwise."""
    if not differentiable(old) or old.shape != new.shape or old.dtype != new.dtype:
        return new
    if detached or cutting():
        return straight_through(old, new)
    return new


# ---------------------------------------------------------------------------
# custom autograd.Function forwards are not cut
# ---------------------------------------------------------------------------

_function_apply = torch.autograd.Function.apply.__func__


def _apply(cls, *args, **kwargs):
    # counted even when called eagerly: the forward may trace (torch2jax's own Functions do)
    _state.functions += 1
    try:
        return _function_apply(cls, *args, **kwargs)
    finally:
        _state.functions -= 1


_apply.__doc__ = _function_apply.__doc__


def install() -> None:
    """Route ``torch.autograd.Function.apply`` through `_apply` (idempotent)."""
    if torch.autograd.Function.apply.__func__ is not _apply:
        torch.autograd.Function.apply = classmethod(_apply)
