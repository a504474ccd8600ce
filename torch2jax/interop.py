"""Moving between torch and JAX: values, functions and modules.

* `jax_view` / `torch_view` convert values (any pytree of them) and callables:
  a torch callable becomes a function over jax arrays, a jax callable one over
  torch tensors. No data is copied for tensors on the jax device.
* `call_jax` runs a JAX function on torch tensors inside torch autograd (its
  backward is the JAX VJP); `call_torch` runs a torch function on jax arrays
  inside JAX transforms (jit, grad, vmap), since every op it runs is lowered to
  JAX.
* `functionalize` turns a module into a pure function of its state.

Example::

    fn, state = t2j.functionalize(model)
    loss = lambda s, x: fn(s, x).sum()
    grads = jax.jit(jax.grad(loss))(state, x)        # JAX gradients of a torch model
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree

from . import gradcut as _gradcut
from . import tensor as _tensor
from .pytree import ensure_jax_pytree
from .env import default_rng as _rng
from .tensor import Tensor, jax_array, new_tensor


@contextlib.contextmanager
def _torch_context():
    # 64-bit types as in torch; backward on this thread, so it runs inside a JAX trace.
    with jax.enable_x64(True), torch.autograd.set_multithreading_enabled(False):
        yield


@contextlib.contextmanager
def _jax_differentiated():
    """`_torch_context` for torch code that JAX differentiates: grad mode on whatever the
    caller's, so that only the code's own ``no_grad`` blocks cut gradients (gradcut.py)."""
    with _torch_context(), torch.enable_grad():
        yield


def _to_jax(x):
    if isinstance(x, Tensor):
        if _tensor.CAPTURE is not None:
            _tensor.CAPTURE.read(x)
        return x._value()
    if isinstance(x, torch.Tensor):
        return jax_array(x)
    return x


def _to_torch(x):
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return new_tensor(x)
    if isinstance(x, np.ndarray):
        return new_tensor(jax.numpy.asarray(x))
    return x


def _is_jax_leaf(x):
    return isinstance(x, (jax.Array, jax.core.Tracer, torch.Tensor, np.ndarray))


def jax_view(x):
    """JAX side of ``x``: tensors become jax.Arrays; a torch callable becomes a
    function over jax arrays that returns jax arrays.

    >>> t2j.jax_view({"w": torch.ones(2, device="jax")})
    {'w': Array([1., 1.], dtype=float32)}
    >>> jnp_relu = t2j.jax_view(torch.relu)        # usable under jax.jit / jax.grad
    """
    if callable(x) and not isinstance(x, torch.Tensor):
        return _JaxCallable(x)
    out = torch_pytree.tree_map(_to_jax, x)
    ensure_jax_pytree(out)
    return out


def torch_view(x):
    """Torch side of ``x``: jax arrays become `torch2jax.Tensor`; a JAX callable
    becomes a function over torch tensors that returns torch tensors.

    >>> t2j.torch_view(jnp.ones(2))
    tensor([1., 1.], device='jax:0')
    """
    if callable(x) and not isinstance(x, (jax.Array, torch.Tensor)):
        return _TorchCallable(x)
    return jax.tree_util.tree_map(_to_torch, x, is_leaf=_is_jax_leaf)


class _JaxCallable:
    """A torch callable seen from JAX (see `jax_view`)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        args, kwargs = torch_view((args, kwargs))
        with _jax_differentiated():
            out = self.fn(*args, **kwargs)
        return jax_view(out)


class _TorchCallable:
    """A JAX callable seen from torch (see `torch_view`)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return call_jax(self.fn, *args, **kwargs)


# ---------------------------------------------------------------------------
# call_jax: JAX inside torch autograd
# ---------------------------------------------------------------------------


def _differentiable(x):
    return isinstance(x, torch.Tensor) and x.requires_grad and (x.is_floating_point() or x.is_complex())


def _conj(arrays):
    return [a.conj() if a is not None and jax.numpy.iscomplexobj(a) else a for a in arrays]


def torch_pullback(pull, primals, cotangents):
    """``pull(primals, cotangents)``, a VJP in JAX's convention, taking and giving gradients in
    torch's: for a complex value, torch's gradient is the conjugate of JAX's cotangent."""
    return _conj(pull(primals, _conj(cotangents)))


def zero_cotangent(aval):
    """The cotangent of an output no gradient reached: zeros, of JAX's ``float0`` for an integer one."""
    if jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact):
        return jax.numpy.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def differentiable_vjp(pull, primals, grads, avals):
    """The gradients a torch2jax Function's backward returns for ``primals``, computed as
    `call_jax` of its VJP ``pull(primal_arrays, cotangent_arrays)`` (JAX's convention), so that
    a second backward differentiates them again in JAX, and a third, to any order.

    A backward under ``create_graph=True`` (`gradcut.creates_graph`) uses it in place of
    its first-order VJP, e.g. a gradient penalty through a compiled forward::

        if _gradcut.creates_graph((*ctx.inputs, *grads)):
            return (None, *differentiable_vjp(lambda ps, cs: jax.vjp(f, *ps)[1](cs), ctx.inputs, grads,
                                              ctx.avals))
    """
    cotangents = [zero_cotangent(a) if g is None else g for g, a in zip(grads, avals)]
    return list(call_jax(lambda ps, cs: torch_pullback(pull, ps, cs), list(primals), cotangents))


class _JaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, *tensors):
        with jax.enable_x64(True):
            outs, ctx.vjp = jax.vjp(call, *[_to_jax(t) for t in tensors])
        ctx.call, ctx.inputs = call, tensors
        ctx.out_avals = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
        return tuple(new_tensor(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        if _gradcut.creates_graph((*ctx.inputs, *grads)):
            return (None, *differentiable_vjp(lambda ps, cs: jax.vjp(ctx.call, *ps)[1](cs), ctx.inputs, grads,
                                              ctx.out_avals))
        cotangents = [zero_cotangent(a) if g is None else _to_jax(g) for g, a in zip(grads, ctx.out_avals)]
        with jax.enable_x64(True):
            return (None, *[new_tensor(g) for g in torch_pullback(lambda _, c: ctx.vjp(c), None, cotangents)])


def call_jax(jax_fn, *args, **kwargs):
    """Call JAX function ``jax_fn`` on torch tensors (any pytree of them) and get
    torch tensors back; torch autograd flows through it, with JAX's VJP as the
    backward.

    >>> w = torch.randn(3, device="jax", requires_grad=True)
    >>> loss = t2j.call_jax(lambda v: jnp.sum(jnp.sin(v) ** 2), w)
    >>> loss.backward()                       # w.grad from jax.vjp
    """
    leaves, spec = torch_pytree.tree_flatten((args, kwargs))
    diff = [i for i, x in enumerate(leaves) if _differentiable(x)]
    arrays = [_to_jax(x) for x in leaves]
    out_tree = {}

    def call(*diff_arrays):
        filled = list(arrays)
        for i, a in zip(diff, diff_arrays):
            filled[i] = a
        a, k = torch_pytree.tree_unflatten(filled, spec)
        out = jax_fn(*a, **k)
        flat, out_tree["def"] = jax.tree_util.tree_flatten(out)
        return flat

    if not diff or not torch.is_grad_enabled():
        with jax.enable_x64(True):
            flat = call(*[arrays[i] for i in diff])
        return jax.tree_util.tree_unflatten(out_tree["def"], [_to_torch(o) for o in flat])

    outs = _JaxFunction.apply(call, *[leaves[i] for i in diff])
    return jax.tree_util.tree_unflatten(out_tree["def"], list(outs))


def call_torch(torch_fn, *args, **kwargs):
    """Call torch function ``torch_fn`` on jax arrays (any pytree of them) and get
    jax arrays back. Every op it runs is a JAX op, so `jax.jit`, `jax.grad` and
    `jax.vmap` see straight through it.

    >>> jax.grad(lambda x: t2j.call_torch(lambda t: (t.sin() ** 2).sum(), x))(jnp.ones(3))
    """
    return jax_view(torch_fn)(*args, **kwargs)


# ---------------------------------------------------------------------------
# functionalize: a module as a pure function of its state
# ---------------------------------------------------------------------------


class Functional:
    """A module as a pure function of its state (see `functionalize`)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, state, *args, rng=None, **kwargs):
        return self.apply(state, *args, rng=rng, **kwargs)[0]

    def apply(self, state, *args, rng=None, **kwargs):
        """Like calling the function, and also return the new state: buffers the
        forward updated in place (BatchNorm running statistics, counters, caches)
        and parameters it wrote (weight clipping).

        >>> out, state = fn.apply(state, x)
        """
        tensors = {name: new_tensor(a) for name, a in state.get("params", {}).items()}
        buffers = {name: new_tensor(a) for name, a in state.get("buffers", {}).items()}
        tensors.update(buffers)
        args, kwargs = torch_view((args, kwargs))
        rng_scope = _rng.traced_key(rng) if rng is not None else contextlib.nullcontext()
        with _jax_differentiated(), rng_scope:
            out = torch.func.functional_call(self.module, tensors, args, kwargs, tie_weights=True, strict=False)
        new_state = {"params": {n: tensors[n]._value() for n in state.get("params", {})},
                     "buffers": {n: b._value() for n, b in buffers.items()}}
        return jax_view(out), new_state


def functionalize(module: torch.nn.Module):
    """``fn, state = functionalize(module)``: a pure function of a state pytree.

    ``state`` is ``{"params": {name: jax.Array}, "buffers": {name: jax.Array}}``
    (a weight shared by two submodules appears once and stays shared).
    ``fn(state, *args, rng=None, **kwargs)`` runs the module's forward on jax
    arrays and returns jax arrays; use it under `jax.jit`, `jax.grad`, `jax.vmap`
    and `jax.lax.scan`. The module's train/eval mode applies; random ops
    (dropout) draw from ``rng``, a JAX key, which is required under a JAX
    transform. ``fn.apply(state, ...)`` also returns the updated state (new
    BatchNorm running statistics in train mode).

    >>> fn, state = t2j.functionalize(torch.nn.Linear(4, 2))
    >>> y = jax.jit(fn)(state, jnp.ones((3, 4)))
    """
    params = {name: _to_jax(p.detach()) for name, p in module.named_parameters()}
    buffers = {name: _to_jax(b) for name, b in module.named_buffers()}
    return Functional(module), {"params": params, "buffers": buffers}
