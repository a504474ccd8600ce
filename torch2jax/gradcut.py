"""torch's autograd graph cuts, kept when JAX differentiates torch code.

When JAX differentiates a traced torch program (the outputs of a `t2j.jit`
function or of `t2j.compile` going into ``loss.backward()``, `functionalize`
under `jax.grad`, `call_torch`), it follows the data. torch follows its
autograd graph, which the data does not show: a value computed under
``torch.no_grad()`` or read through ``detach()`` or ``.data`` carries no gradient,
and a write made with grad mode off or through ``.data`` (weight clipping, an optimizer
step) leaves the tensor where it was in the graph: later reads send their
gradient to the tensor as it was before the write.

While JAX traces (never in eager mode, where JAX does not differentiate), the
dispatcher marks the cuts in the program:

* an op run with grad mode off returns `stop` (`jax.lax.stop_gradient`) values,
  and its views read through ``tensor.DETACHED``;
* ``detach()`` and ``.data`` are views through ``tensor.DETACHED``, which stops the
  gradient on read (autograd's own detaches, of the tensors it saves, are not: they
  differentiate again under ``create_graph``);
* a write with grad mode off, or through a detached view, is `straight_through`:
  the new value with the old value's tangent.

A custom `torch.autograd.Function` runs its forward with grad mode off; its
forward is not cut. One defined outside torch differentiates with its own
``backward`` (`_with_own_backward`); JAX differentiates the ops of torch's own
(reentrant checkpointing, collectives), whose backward is their derivative.

Example::

    def loss(w, x):
        with torch.no_grad():
            scale = x.abs().max()       # a constant for the gradient, as in torch
        return ((w * x) / scale).sum()

    jax.grad(t2j.jax_view(loss))(w, x)  # d/dw only through w * x
"""

from __future__ import annotations

import collections
import contextlib
import threading
import types

import jax
import jax.numpy as jnp
import torch
from jax._src import core as _jax_core
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import Primitive

from .env import default_rng as _rng

_TRACE = _jax_core.trace_state_strong_ref
_EvalTrace = _jax_core.EvalTrace
_DynamicJaxprTrace = _pe.DynamicJaxprTrace
_grad_enabled = torch.is_grad_enabled


class _State(threading.local):
    functions = 0  # how many autograd.Function.apply calls are running on this thread
    jax_differentiated = 0  # how many blocks of torch code JAX differentiates are running (`interop`)


_state = _State()


def cutting() -> bool:
    """Whether an op running now must cut its results: JAX is tracing and grad mode
    is off, and no autograd.Function's forward (which turns grad mode off) is running."""
    return not _grad_enabled() and not isinstance(_TRACE.value, _EvalTrace) and not _state.functions


def jax_may_differentiate() -> bool:
    """Whether JAX may differentiate the values made now: it is tracing (staging a program, or a
    transform such as `jax.grad` is running)."""
    return not isinstance(_TRACE.value, _EvalTrace)


def is_staging() -> bool:
    """Whether JAX is staging a program now (`t2j.jit`, `jax.jit`, a loop body), not running a
    transform of values such as `jax.grad` on concrete inputs."""
    return isinstance(_TRACE.value, _DynamicJaxprTrace)


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


@contextlib.contextmanager
def as_caller():
    """For user code that one of torch2jax's Functions runs in its forward for JAX to
    differentiate (the body of `t2j.scan`, `cond`, `scan_layers`, `checkpoint`): grad mode
    on, as at the call, and not counted as a Function's forward. The code's own
    ``no_grad`` blocks then cut its gradients, and code that asks ``torch.is_grad_enabled()``
    (transformers' gradient checkpointing) sees the caller's mode."""
    functions, _state.functions = _state.functions, 0
    try:
        with torch.enable_grad():
            yield
    finally:
        _state.functions = functions

_function_apply = torch.autograd.Function.apply.__func__


def _apply(cls, *args, **kwargs):
    # counted even when called eagerly: the forward may trace (torch2jax's own Functions do)
    _state.functions += 1
    try:
        if isinstance(_TRACE.value, _EvalTrace) or cls.__module__.split(".")[0] in ("torch", "torch2jax"):
            return _function_apply(cls, *args, **kwargs)
        return _with_own_backward(cls, args, kwargs)
    finally:
        _state.functions -= 1


class Reads:
    """While code runs (a Function's forward, a shard_map body): the tensors it reads whose storages are
    neither ``known`` (its inputs' ids) nor made by it (closed-over tensors), each with its storage's
    value before the run, in ``found`` (storage id -> (tensor, array))."""

    def __init__(self, known):
        from . import tensor as _tensor

        self.tensor, self.known, self.found = _tensor, set(known), {}

    def __enter__(self):
        self.block = self.tensor.traced_block()
        self.block.__enter__()
        self.outer, self.tensor.CAPTURE = self.tensor.CAPTURE, self
        return self

    def __exit__(self, *exc):
        self.tensor.CAPTURE = self.outer
        self.block.__exit__(*exc)

    def created(self, storage):
        self.known.add(id(storage))
        if self.outer is not None:
            self.outer.created(storage)

    def read(self, t):
        st = t._t2j_storage
        if id(st) not in self.known:
            self.found.setdefault(id(st), (t, st.array))
        if self.outer is not None:
            self.outer.read(t)


def _rebindable(o, inputs) -> bool:
    """Whether Function output ``o`` can take a value of its own: a floating tensor that
    is not an input, and, where it is a view of one (``x.view_as(x)``), a contiguous
    one from its storage's start (its value is then its whole storage)."""
    if not (o.is_floating_point() or o.is_complex()) or any(o is t for t in inputs):
        return False
    return not o._t2j_view or (o.is_contiguous() and o.storage_offset() == 0)


def plain_object(a) -> bool:
    """An argument whose attributes a Function's forward may change: a Python object that is
    not a tensor, an nn.Module, a class, a function or a Python module (an HF cache the layers
    append to)."""
    return (hasattr(a, "__dict__") and not isinstance(a, (torch.Tensor, torch.nn.Module, type, types.FunctionType,
                                                             types.MethodType, types.ModuleType)))


def _copied(attributes: dict) -> dict:
    return {k: list(v) if type(v) is list else dict(v) if type(v) is dict else v for k, v in attributes.items()}


def attributes_of(objects) -> list:
    """The attributes of ``objects``, their lists and dicts copied: what `put_attributes` puts back."""
    return [(o, _copied(vars(o))) for o in objects]


def put_attributes(saved):
    for o, attributes in saved:
        vars(o).clear()
        vars(o).update(_copied(attributes))


def _with_own_backward(cls, args, kwargs):
    """``cls.apply(*args, **kwargs)`` while JAX traces, its results differentiated by JAX
    with ``cls.backward``: a `jax.custom_vjp` whose forward and backward rerun the
    Function on fresh tensors (torch's autograd then calls ``backward``). Tensors the
    forward closes over are inputs of the `jax.custom_vjp` with no gradient, as in torch,
    where the forward runs with grad mode off; writes the reruns make are undone, and they
    draw the first run's random numbers (a dropout mask in the forward: its ``backward``
    sees the mask the outputs were made with).

    While JAX stages a program (`t2j.jit`, `jax.jit`) the `jax.custom_vjp`'s value is the
    first run's, so the forward runs once unless JAX differentiates the program (then once
    more for the residuals and once in the backward)."""
    import torch.utils._pytree as pytree

    from .tensor import Storage, Tensor, new_tensor

    leaves, spec = pytree.tree_flatten((args, kwargs))
    pos = [i for i, a in enumerate(leaves) if isinstance(a, Tensor)]
    inputs = [leaves[i] for i in pos]
    # the reruns start from the objects the arguments hold as the first run found them, and leave them
    # as it did: its changes (a cache the layers append to) are made once
    objects = [a for a in leaves if plain_object(a)]
    before = attributes_of(objects)
    key = _rng._traced  # None where random ops draw from the stored key
    with Reads({id(t._t2j_storage) for t in inputs}) as reads:
        out = _function_apply(cls, *args, **kwargs)  # autograd's node, for a backward() inside the trace
    after = attributes_of(objects)
    closure = [(t._t2j_storage, a) for t, a in reads.found.values()]
    traced = [k for k, (_, a) in enumerate(closure) if isinstance(a, jax.core.Tracer)]
    if not any(differentiable(t._value()) for t in inputs) and not any(differentiable(closure[k][1]) for k in traced):
        return out
    flat_out = pytree.tree_leaves(out)
    fresh = [k for k, o in enumerate(flat_out) if isinstance(o, Tensor) and _rebindable(o, inputs)]
    if not fresh:
        return out
    diff = [differentiable(t._value()) for t in inputs]
    n, m = len(inputs), len(traced)

    def run(arrays, grad, then):
        """Rerun the Function on tensors holding ``arrays`` (its inputs, the traced
        closed-over values, then the RNG key the first run drew from, where it drew from
        a traced one), and return ``then(fresh outputs, input tensors)``."""
        filled = list(leaves)
        tensors = [new_tensor(a).requires_grad_(grad and d) for a, d in zip(arrays[:n], diff)]
        for i, t in zip(pos, tensors):
            filled[i] = t
        a, k = pytree.tree_unflatten(filled, spec)
        values = [a for _, a in closure]
        for k_, a_ in zip(traced, arrays[n:]):
            values[k_] = a_
        now = [st.array for st, _ in closure]
        for (st, _), v in zip(closure, values):
            st.array, st.version = v, st.version + 1
        put_attributes(before)
        drawn = _rng._traced, _rng.draws
        if key is not None:
            _rng._traced = arrays[n + m]
        try:
            with torch.enable_grad():
                res = pytree.tree_leaves(_function_apply(cls, *a, **k))
            return then([res[j] for j in fresh], tensors)
        finally:
            for (st, _), v in zip(closure, now):
                st.array, st.version = v, st.version + 1
            put_attributes(after)
            _rng._traced, _rng.draws = drawn

    # While JAX stages the program, the value is the first run's (the custom VJP differentiates
    # it); a later trace (JAX differentiating the staged program) reruns the forward.
    first = [jax.lax.stop_gradient(flat_out[j]._value()) for j in fresh]
    staging = [is_staging()]

    def primal(arrays):
        return run(arrays, False, lambda outs, _: [o._value() for o in outs])

    @jax.custom_vjp
    def call(*arrays):
        return first if staging[0] else primal(arrays)

    def fwd(*arrays):
        return primal(arrays), arrays

    def backward(cotangents, outs, tensors):
        pairs = [(o, new_tensor(c)) for o, c in zip(outs, cotangents) if o.requires_grad]
        wrt = [t for t in tensors if t.requires_grad]
        # create_graph: the backward's ops run with grad mode on, so JAX differentiates them again (a
        # Hessian); without it torch runs them under no_grad, which cuts their gradients (`cutting`)
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True,
                                         create_graph=True)
                     if pairs and wrt else [None] * len(wrt))
        result = [next(grads) if t.requires_grad else None for t in tensors]
        return [None if g is None else g._value() for g in result]

    def bwd(arrays, cotangents):
        grads = run(arrays, True, lambda outs, tensors: backward(cotangents, outs, tensors))
        return (*grads, *[None] * (len(arrays) - n))

    call.defvjp(fwd, bwd)
    arrays = [t._value() for t in inputs] + [closure[k][1] for k in traced] + ([] if key is None else [key])
    values = call(*arrays)
    staging[0] = False
    for k, a in zip(fresh, values):
        o = flat_out[k]
        if o._t2j_view:  # a view of an input: its own value from now on, as torch's custom backward gives it
            o._t2j_storage, o._t2j_view = Storage(a), ()
        else:
            o._t2j_storage.array = a
            o._t2j_storage.version += 1
    return out


_apply.__doc__ = _function_apply.__doc__



class _Refusing(torch.autograd.Function):
    """Gradients a backward computed in JAX, as the outputs of a node whose own backward
    raises: torch records no graph of how they were computed. Used where the backward cannot
    be one JAX function of the node's inputs (`interop.differentiable_vjp`)."""

    @staticmethod
    def forward(ctx, name, n, *tensors):
        ctx.name = name
        return tuple(g.clone() for g in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.name} computes its gradients in JAX, so they cannot be differentiated again: a second "
            "backward through them (create_graph=True, then a gradient of the gradients) would miss every "
            "term that passes through it. Differentiate with jax.grad / jax.hessian on a functionalized "
            "module (t2j.functionalize), or run this part eagerly."
        )


def hook_where_jax_differentiates(t, hook, handle=None):
    """``t.register_hook(hook)`` inside torch code that JAX differentiates (`call_torch`,
    `functionalize` under `jax.grad`), where torch's engine, which runs hooks, is not what
    computes the gradients: from here on ``t`` holds its value through an identity whose VJP
    gives ``hook`` the gradient and passes on what it returns, until the returned handle (or
    ``handle``, torch's own, where ``t`` requires grad) is removed. Uses of ``t`` before the
    hook was registered do not reach it. Views refuse: a hook on their gradient is not one on
    their storage's."""
    from .tensor import new_tensor

    if t._t2j_view:
        raise RuntimeError(
            "torch2jax: register_hook on a view inside torch code JAX differentiates (call_torch, "
            "functionalize under jax.grad) is not supported: register it on a clone (y = y.clone())")
    own = None
    if handle is None:
        own = collections.OrderedDict()  # (the handle refers to it weakly: a plain dict cannot be)
        handle = torch.utils.hooks.RemovableHandle(own)
        own[handle.id] = hook

    def registered() -> bool:
        hooks = own if own is not None else handle.hooks_dict_ref()
        return hooks is not None and handle.id in hooks

    @jax.custom_vjp
    def identity(a):
        return a

    def backward(_, g):
        if not registered():
            return (g,)
        out = hook(new_tensor(g))
        return (g if out is None else out._value().astype(g.dtype),)

    identity.defvjp(lambda a: (a, None), backward)
    t._t2j_storage.array = identity(t._t2j_storage.array)
    t._t2j_storage.version += 1
    return handle


def creates_graph(inputs) -> bool:
    """Whether the backward running now must record how its gradients depend on ``inputs``
    (its saved inputs and incoming gradients): ``create_graph=True`` with one requiring grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


def once_differentiable(name, grads, inputs):
    """``grads`` (the results of a backward that computed them in JAX) as they are, or, under
    ``create_graph=True`` where they depend on ``inputs`` that require grad, as outputs of a
    node that raises if a second backward reaches it (as torch.compile's compiled backward
    does) instead of silently contributing nothing.

    >>> return (None, *once_differentiable("t2j.jit", grads, (*ctx.inputs, *grad_outputs)))
    """
    needs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    present = [g for g in grads if g is not None]
    if not creates_graph(inputs) or not present:
        return grads
    refused = iter(_Refusing.apply(name, len(present), *present, *needs))
    return tuple(None if g is None else next(refused) for g in grads)


def install() -> None:
    """Route ``torch.autograd.Function.apply`` through `_apply` (idempotent)."""
    if torch.autograd.Function.apply.__func__ is not _apply:
        torch.autograd.Function.apply = classmethod(_apply)
