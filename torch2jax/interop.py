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
import functools
import operator

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax._src import config as _jax_config

from . import dtypes as _dt
from . import gradcut as _gradcut
from . import symbolic as _sym
from .dispatch import inexact as _inexact
from . import tensor as _tensor
from .pytree import ensure_jax_pytree, with_arrays
from .env import _trace_state_clean
from .env import check_key as _check_key
from .env import default_rng as _rng
from .tensor import Tensor, jax_array, new_tensor


@contextlib.contextmanager
def _torch_context():
    # 64-bit types as in torch; backward on this thread, so it runs inside a JAX trace. Inside one,
    # ``t.item()`` is a traced number: Python and torch functions given one keep it traced
    # (`symbolic.traced_builtins`) or refuse it, as in t2j.jit.
    # torch.distributions' argument checks become checks the program makes when it runs (`_checks_when_run`)
    from .jit import _checks_when_run

    staged = not _trace_state_clean()
    traced = _sym.traced_builtins() if staged else contextlib.nullcontext()
    validation = _checks_when_run() if staged else contextlib.nullcontext()
    with jax.enable_x64(True), torch.autograd.set_multithreading_enabled(False), traced, validation:
        yield


@contextlib.contextmanager
def _jax_differentiated():
    """`_torch_context` for torch code that JAX differentiates: grad mode on whatever the
    caller's, so that only the code's own ``no_grad`` blocks cut gradients (gradcut.py). The
    tensors made in the block (the code's arguments and a module's state, made from the caller's arrays,
    the buffers it allocates) are the call's own: JAX's tracers may be written into them in place
    (`tensor.call_scope`)."""
    _gradcut._state.jax_differentiated += 1
    try:
        with _torch_context(), torch.enable_grad(), _tensor.call_scope():
            yield
    finally:
        _gradcut._state.jax_differentiated -= 1


def _to_jax(x):
    if isinstance(x, Tensor):
        if _tensor.CAPTURE is not None:
            _tensor.CAPTURE.read(x)
        return x._value()
    if isinstance(x, torch.Tensor):
        return jax_array(x)
    if _sym.is_traced_number(x):  # (``t.item()`` under a JAX trace: its traced value, a 0-d array)
        return _sym.value_of(x)
    if isinstance(x, (int, float, bool, str, type(None))):
        return x
    converted = with_arrays(x, _to_jax)  # an object holding tensors (an HF DynamicCache)
    return x if converted is None else converted


def _to_torch(x):
    if isinstance(x, (jax.Array, jax.core.Tracer)) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return x  # a typed PRNG key: no torch dtype holds one, and JAX code (call_jax) takes it as it is
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return new_tensor(x)
    if isinstance(x, np.ndarray):
        with jax.enable_x64(True):  # its own dtype, as torch.as_tensor keeps it
            return new_tensor(jax.numpy.asarray(x))
    return x


def _is_key(x) -> bool:
    """Whether ``x`` is an array of JAX's typed PRNG keys (``jax.random.key``)."""
    return isinstance(x, (jax.Array, jax.core.Tracer)) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)


def _inexact_array(x) -> bool:
    return jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)


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
        x64 = _jax_config.enable_x64.get_global()
        # (the arguments' tensors are the call's own: it may write into them). JAX differentiates the code, also
        # inside a JAX function torch.func's transforms reach through call_jax: their levels are not its own
        outside = _functorch_levels_cleared() if torch._C._functorch.maybe_current_level() is not None \
            else contextlib.nullcontext()
        with outside, _jax_differentiated():
            args, kwargs = _as_given(torch_view((args, kwargs)), x64)
            out = _as_returned(self.fn(*args, **kwargs), x64)
        return jax_view(out)


def _functorch_levels_cleared():
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()


def _as_given(tree, x64):
    """The tensors of ``tree``, from JAX code, as torch code gets them: without JAX's 64-bit
    types (``x64`` False) JAX's integers are int32, and they become torch's int64 (class labels
    and indices must be), as `_as_returned` makes torch's int64 JAX's int32 on the way back."""
    if x64:
        return tree
    return torch_pytree.tree_map(lambda t: t.long() if isinstance(t, torch.Tensor) and t.dtype == torch.int32 else t,
                                 tree)


def _as_returned(tree, x64):
    """The tensors of ``tree`` as JAX code running without JAX's 64-bit types gets them:
    64-bit dtypes narrowed as JAX narrows them (`_NARROWER`), so they mix with its own arrays."""
    if x64:
        return tree

    def narrowed(t):
        if _sym.is_traced_number(t):  # (a traced ``t.item()``: its value, a 0-d array, narrowed the same way)
            return _as_seen(_sym.value_of(t), x64)
        if not isinstance(t, torch.Tensor) or t.dtype is torch.complex32:  # (held as complex64, returned so)
            return t
        narrower = _NARROWER.get(np.dtype(_dt.to_jax(t.dtype)))
        return t if narrower is None else t.to(_dt.to_torch(narrower))

    return torch_pytree.tree_map(narrowed, tree)


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
    return isinstance(x, torch.Tensor) and x.requires_grad and _inexact(x)


def _conj(arrays):
    return [a.conj() if a is not None and jax.numpy.iscomplexobj(a) else a for a in arrays]


def torch_pullback(pull, primals, cotangents):
    """``pull(primals, cotangents)``, a VJP in JAX's convention, taking and giving gradients in
    torch's: for a complex value, torch's gradient is the conjugate of JAX's cotangent."""
    return _conj(pull(primals, _conj(cotangents)))


def zero_cotangent(aval):
    """The cotangent of an output no gradient reached: zeros, of JAX's ``float0`` for an integer one."""
    if jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact):
        with jax.enable_x64(True):  # (the output's own dtype, float64 too, whatever the caller's mode)
            return jax.numpy.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def differentiable_vjp(pull, primals, grads, avals, x64=True):
    """The gradients a torch2jax Function's backward returns for ``primals`` (None for an integer
    one), computed as
    `call_jax` of its VJP ``pull(primal_arrays, cotangent_arrays)`` (JAX's convention), so that
    a second backward differentiates them again in JAX, and a third, to any order. ``x64``:
    whether ``pull`` runs with JAX's 64-bit types (torch2jax's own programs do).

    A backward under ``create_graph=True`` (`gradcut.creates_graph`) uses it in place of
    its first-order VJP, e.g. a gradient penalty through a compiled forward::

        if _gradcut.creates_graph((*ctx.inputs, *grads)):
            return (None, *differentiable_vjp(lambda ps, cs: jax.vjp(f, *ps)[1](cs), ctx.inputs, grads,
                                              ctx.avals))
    """
    cotangents = [zero_cotangent(a) if g is None else g for g, a in zip(grads, avals)]
    # an integer primal's gradient is JAX's float0, which no torch tensor holds: it gets None
    inexact = list(map(_inexact, primals))

    def pull_inexact(ps, cs):
        return [g for g, keep in zip(torch_pullback(pull, ps, cs), inexact) if keep]

    reaches = _pull_reaches(pull, pull_inexact, primals, cotangents, x64)
    got = iter(_call_jax(pull_inexact, (list(primals), cotangents), {}, x64, reaches))
    return [next(got) if keep else None for keep in inexact]


_REACHES: dict = {}  # (the VJP's function, its argument types) -> `_pull_reaches`


def _pull_reaches(pull, pull_inexact, primals, cotangents, x64) -> tuple:
    """Per gradient ``pull_inexact`` returns, the primals and cotangents (a bit set, in that order)
    it depends on: a backward through the gradients gives no gradient (None, as torch's graph with
    no path) to the others, e.g. a last layer's bias in a gradient penalty. Kept per ``pull``'s
    function (a jitted forward's, the same for every call) and argument types."""
    from .jit import _output_dependencies

    args = [jax.ShapeDtypeStruct(tuple(x.shape), _dt.to_jax(x.dtype)) if isinstance(x, torch.Tensor)
            else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*primals, *cotangents)]
    key = (getattr(pull, "func", pull), tuple(args), x64)
    if key not in _REACHES:
        if len(_REACHES) > 256:
            _REACHES.clear()
        n = len(primals)
        with jax.enable_x64(x64):
            closed = jax.make_jaxpr(lambda *a: pull_inexact(list(a[:n]), list(a[n:])))(*args)
        _REACHES[key] = tuple(_output_dependencies(closed.jaxpr, [1 << i for i in range(len(args))]))
    return _REACHES[key]


# Without JAX's 64-bit types, JAX turns 64-bit arrays into these (warning at every op)
_NARROWER = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32),
             np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.complex128): np.dtype(np.complex64)}


def _as_seen(x, x64):
    """Argument ``x`` as JAX code running with (``x64``) or without 64-bit types sees it."""
    if x64 or not isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    narrower = _NARROWER.get(x.dtype)  # (a typed PRNG key has an extended dtype: none)
    return x if narrower is None else x.astype(narrower)


def _gradient_for(t, g):
    """JAX's gradient ``g`` for input tensor ``t``, in its dtype and on its device."""
    if t.dtype is torch.complex32:  # (JAX has no complex32: torch's cast rounds the complex64 gradient)
        return new_tensor(g.astype(jax.numpy.complex64)).to(t.device, t.dtype)
    with jax.enable_x64(True):
        g = new_tensor(g.astype(_dt.to_jax(t.dtype)))
    return g if isinstance(t, Tensor) else g.to(t.device)


def _vjp_reaches(vjp, n_in: int, n_out: int) -> tuple | None:
    """Per output of a function, the inputs its VJP ``vjp`` (``jax.vjp``'s) gives gradients (a bit set),
    read from the linear program JAX keeps for it: an input no output depends on gets None, as with
    no path in torch's graph (AdamW then skips its decay). None where JAX keeps no such program."""
    from .jit import _output_dependencies

    jaxpr = getattr(vjp, "jaxpr", None)
    if not isinstance(jaxpr, jax.extend.core.Jaxpr) or len(jaxpr.invars) != n_in or len(jaxpr.outvars) != n_out:
        return None
    return tuple(_output_dependencies(jaxpr, [1 << i for i in range(n_in)]))


class _Saved:
    """What `_JaxFunction.forward` hands to its ``setup_context`` (an object, not a pytree,
    so that torch.func passes it through as it is)."""

    vjp = avals = arrays = reaches = None


class _JaxFunction(torch.autograd.Function):
    """``call(*arrays)`` as one node of torch's autograd graph over ``tensors``, its backward
    JAX's VJP. In torch.func's form (``setup_context``, ``jvp``, ``vmap``) so that torch.func's
    transforms go through it; ``saved`` (a `_Saved`) carries the VJP from ``forward`` to ``setup_context``."""

    @staticmethod
    def forward(call, x64, saved, *tensors):
        with jax.enable_x64(x64):
            saved.arrays = [_as_seen(_to_jax(t), x64) for t in tensors]
            if any(isinstance(a, jax.core.Tracer) for a in saved.arrays):
                # staged (a t2j.jit trace): ``call`` itself, so that JAX differentiating the program
                # meets its jax.custom_vjp / custom_jvp rules, where jax.vjp would leave their forward's
                # ops; the backward takes its VJP then (`differentiable_vjp`)
                outs, saved.vjp = call(*saved.arrays), None
            else:
                outs, saved.vjp = jax.vjp(call, *saved.arrays)
                if saved.reaches is None:
                    saved.reaches = _vjp_reaches(saved.vjp, len(saved.arrays), len(outs))
        saved.avals = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
        # (a PRNG key among the outputs is no tensor: it comes back as the key it is, outside autograd)
        return tuple(o if _is_key(o) else new_tensor(o) for o in outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call, x64, saved, *tensors = inputs
        ctx.call, ctx.x64, ctx.inputs, ctx.vjp, ctx.arrays = call, x64, tensors, saved.vjp, saved.arrays
        ctx.reaches = saved.reaches
        # a tensor of its own that torch frees after a backward without retain_graph, as it frees an op's
        # saved tensors: a second backward through this node then raises torch's error (the inputs
        # themselves are not saved: JAX holds their values, so a later in-place write to one is harmless)
        ctx.save_for_backward(torch.empty(0))
        ctx.set_materialize_grads(False)  # (an output the backward does not reach gives its inputs no gradient)
        # (under torch.func.vmap the forward ran as the vmap rule's: no VJP was saved here)
        ctx.out_avals = [jax.ShapeDtypeStruct(tuple(o.shape), o.dtype if _is_key(o) else _dt.to_jax(o.dtype))
                         for o in output]

    @staticmethod
    def backward(ctx, *grads):
        ctx.saved_tensors  # raises torch's error on a second backward through a freed graph
        # (inputs none of the given gradients' outputs depends on get None, as with no path in torch's graph)
        reached = -1 if ctx.reaches is None else functools.reduce(
            operator.or_, (r for r, g in zip(ctx.reaches, grads) if g is not None), 0)
        if ctx.vjp is None or _gradcut.creates_graph((*ctx.inputs, *grads)):
            got = differentiable_vjp(lambda ps, cs: jax.vjp(ctx.call, *ps)[1](cs), ctx.inputs, grads,
                                     ctx.out_avals, ctx.x64)
            return (None, None, None, *[g.to(t.device, t.dtype) if _inexact(t) and reached >> i & 1 else None
                                        for i, (t, g) in enumerate(zip(ctx.inputs, got))])
        from .jit import _batched_grads, _rebatched

        # a vmap over the backward pass (jacobian(vectorize=True), is_grads_batched=True): one VJP per
        # cotangent along the batch dimension, as jax.vmap of it
        grads, batch, level = _batched_grads(grads)
        avals = ctx.out_avals if batch is None else [jax.ShapeDtypeStruct((batch, *a.shape), a.dtype)
                                                     for a in ctx.out_avals]
        cotangents = [zero_cotangent(a) if g is None else _to_jax(g) for g, a in zip(grads, avals)]
        with jax.enable_x64(ctx.x64):
            pull = functools.partial(torch_pullback, lambda _, c: ctx.vjp(c), None)
            got = pull(cotangents) if batch is None else jax.vmap(pull)(cotangents)
        out = [_gradient_for(t, g) if _inexact(t) and reached >> i & 1 else None
               for i, (t, g) in enumerate(zip(ctx.inputs, got))]
        if batch is not None:
            out = _rebatched(out, level)
        return (None, None, None, *out)

    @staticmethod
    def jvp(ctx, _call, _x64, _saved, *tangents):
        # forward mode (torch.func.jvp, jacfwd, hessian) as jax.jvp, itself through call_jax:
        # the tangents may be torch.func's wrapped tensors
        dots = [jax.numpy.zeros_like(a) if t is None else t for a, t in zip(ctx.arrays, tangents)]

        def push(primals, tangents):
            # (an integer or bool argument's tangent is JAX's float0; an integer result's, zeros of its dtype)
            tangents = [t.astype(p.dtype) if _inexact_array(p) else np.zeros(p.shape, jax.dtypes.float0)
                        for p, t in zip(primals, tangents)]
            outs, dots = jax.jvp(ctx.call, primals, tangents)
            return [jax.numpy.zeros(o.shape, o.dtype) if d.dtype == jax.dtypes.float0 else d
                    for o, d in zip(outs, dots)]

        return tuple(_call_jax(push, (list(ctx.inputs), dots), {}, ctx.x64))

    @staticmethod
    def vmap(info, in_dims, call, x64, saved, *tensors):
        # torch.func.vmap over JAX code is jax.vmap of it
        axes = tuple(in_dims[3:])
        outs = _JaxFunction.apply(jax.vmap(call, in_axes=axes), x64, _Saved(), *tensors)
        return outs, (0,) * len(outs)


def call_jax(jax_fn, *args, **kwargs):
    """Call JAX function ``jax_fn`` on torch tensors (any pytree of them) and get
    torch tensors back; torch autograd flows through it, with JAX's VJP as the
    backward (and torch.func's grad, vmap and jvp, as jax.vjp, jax.vmap and jax.jvp).

    ``jax_fn`` runs under JAX's own configuration: without ``jax_enable_x64`` (JAX's
    default), 64-bit tensors (int64 labels, float64 values) reach it as 32-bit arrays and
    ``jnp.zeros(3)`` is float32, as in any JAX program; gradients come back in the
    tensors' own dtypes.

    Tensors on the jax device give tensors on it; where every tensor is a CPU one, the results
    are CPU tensors too (the arrays are copied in and out).

    >>> w = torch.randn(3, device="jax", requires_grad=True)
    >>> loss = t2j.call_jax(lambda v: jnp.sum(jnp.sin(v) ** 2), w)
    >>> loss.backward()                       # w.grad from jax.vjp
    """
    flat = _flatten_arguments((args, kwargs))
    out = _call_jax(jax_fn, args, kwargs, _jax_config.enable_x64.get_global(), flat=flat)
    tensors = [x for x in flat[0] if isinstance(x, torch.Tensor)]
    if tensors and all(x.device.type == "cpu" for x in tensors):
        return torch_pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), out)
    return out


def call_jax_64(jax_fn, *args, **kwargs):
    """`call_jax` for torch2jax's own JAX code (programs traced from torch, device placement),
    which runs with JAX's 64-bit types whatever JAX's configuration."""
    return _call_jax(jax_fn, args, kwargs, True)


def _call_jax(jax_fn, args, kwargs, x64, reaches=None, flat=None):
    """`call_jax` with (``x64``) or without JAX's 64-bit types; torch2jax's own JAX code
    (programs traced from torch) needs them. ``reaches``: per output, the argument leaves it
    depends on (a bit set), where known: a backward gives the others None. ``flat``: the
    arguments' `_flatten_arguments`, where the caller has it."""
    leaves, rebuild = _flatten_arguments((args, kwargs)) if flat is None else flat
    # torch.func's wrapped tensors (under its grad or vmap) reach JAX only through the Function
    wrapped = any(map(_functorch_wrapped, leaves))
    grad = torch.is_grad_enabled()
    through = [i for i, x in enumerate(leaves) if (grad and _differentiable(x)) or (
        wrapped and isinstance(x, torch.Tensor))]
    passed = set(through)
    arrays = [None if i in passed else _as_seen(_to_jax(x), x64) for i, x in enumerate(leaves)]
    out_tree = {}

    def call(*through_arrays):
        filled = list(arrays)
        for i, a in zip(through, through_arrays):
            filled[i] = a
        a, k = rebuild(filled)
        out = jax_fn(*a, **k)
        flat, out_tree["def"] = jax.tree_util.tree_flatten(out)
        # Python values among the outputs (a count, a name) come back as they are, not through autograd
        out_tree["values"] = [None if _is_jax_leaf(o) else o for o in flat]
        return [o for o in flat if _is_jax_leaf(o)]

    if not through:
        with jax.enable_x64(x64):
            outs = iter(map(_to_torch, call()))
    else:
        saved = _Saved()
        if reaches is not None:  # (as bit sets over the leaves passed through)
            saved.reaches = [sum(1 << j for j, i in enumerate(through) if r >> i & 1) for r in reaches]
        outs = iter(_JaxFunction.apply(call, x64, saved, *[leaves[i] for i in through]))
    return jax.tree_util.tree_unflatten(out_tree["def"], [next(outs) if v is None else v for v in out_tree["values"]])


def _flatten_arguments(tree):
    """The leaves of ``tree`` (`call_jax`'s arguments) and the function rebuilding it from them:
    torch's pytree leaves, and inside those JAX's pytree opens (a dataclass registered with
    ``jax.tree_util``, an object holding tensors), whose tensors are then differentiated as
    any argument's rather than passed as constants."""
    outer, spec = torch_pytree.tree_flatten(tree)
    leaves, parts = [], []
    for leaf in outer:
        inner = None
        if not (_is_jax_leaf(leaf) or _sym.is_traced_number(leaf) or isinstance(leaf, (int, float, bool, str))):
            ensure_jax_pytree(leaf)  # (an object holding tensors: its class registered with JAX)
            inner, treedef = jax.tree_util.tree_flatten(leaf, is_leaf=_is_jax_leaf)
        if inner is not None and any(isinstance(x, torch.Tensor) for x in inner):
            parts.append((len(inner), treedef))
            leaves.extend(inner)
        else:
            parts.append(None)
            leaves.append(leaf)

    def rebuild(flat):
        flat, outer = iter(flat), []
        for part in parts:
            if part is None:
                outer.append(next(flat))
            else:
                outer.append(jax.tree_util.tree_unflatten(part[1], [next(flat) for _ in range(part[0])]))
        return torch_pytree.tree_unflatten(outer, spec)

    return leaves, rebuild


def _functorch_wrapped(x) -> bool:
    return isinstance(x, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(x)


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

    def __init__(self, module: torch.nn.Module, x64: bool | None = None):
        self.module = module
        self._names: dict = {}  # "params" / "buffers" -> the module's names (`_check_state`)
        # whether the JAX code calling it has 64-bit types (None: JAX's configuration, for users'
        # JAX code; torch2jax's own programs, t2j.compile and t2j.export, keep torch's dtypes)
        self.x64 = x64

    def __call__(self, state, *args, rng=None, **kwargs):
        return self.apply(state, *args, rng=rng, **kwargs)[0]

    def apply(self, state, *args, rng=None, **kwargs):
        """Like calling the function, and also return the new state: buffers the
        forward updated in place (BatchNorm running statistics, counters, caches)
        and parameters it wrote (weight clipping).

        >>> out, state = fn.apply(state, x)
        """
        self._check_state(state)
        if rng is not None:
            _check_key(rng, "functionalize: the function's rng=")
        x64 = _jax_config.enable_x64.get_global() if self.x64 is None else self.x64
        rng_scope = _rng.traced_key(rng) if rng is not None else contextlib.nullcontext()
        with _jax_differentiated(), rng_scope:
            # (the state's and arguments' tensors are made for the call: a transform may write its tracers into them)
            tensors = {name: _state_tensor("params", name, a) for name, a in state.get("params", {}).items()}
            buffers = {name: _state_tensor("buffers", name, a) for name, a in state.get("buffers", {}).items()}
            tensors.update(buffers)
            args, kwargs = _as_given(torch_view((args, kwargs)), x64)
            out = torch.func.functional_call(self.module, tensors, args, kwargs, tie_weights=True, strict=False)
            out = _as_returned(out, x64)
        new_state = {"params": {n: tensors[n]._value() for n in state.get("params", {})},
                     "buffers": {n: b._value() for n, b in buffers.items()}}
        return jax_view(out), new_state

    def write_back(self, state):
        """Make ``state``'s arrays (a state trained by JAX code, ``{"params": ..., "buffers": ...}`` as
        `functionalize` gives it) the values of the module's parameters and buffers, in their dtypes.
        The state `functionalize` returns shares the module's arrays: a jitted step that donates it
        leaves the module without values until its result is written back.

        >>> state = train_step(state, batch)   # jax.jit(..., donate_argnums=0)
        >>> fn.write_back(state)               # the module holds the trained values
        """
        self._check_state(state)
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        for group in ("params", "buffers"):
            for name, a in state.get(group, {}).items():
                t = tensors[name]
                with jax.enable_x64(True):
                    value = jax.numpy.asarray(a, _dt.to_jax(t.dtype))
                if tuple(value.shape) != tuple(t.shape):
                    raise ValueError(f"write_back: {group}[{name!r}] has shape {tuple(value.shape)}, the module's "
                                     f"tensor {tuple(t.shape)}")
                if isinstance(t, Tensor) and not t._t2j_view:
                    t._t2j_storage.array = value
                    t._t2j_storage.version += 1
                else:
                    with torch.no_grad():
                        t.copy_(torch_view(value).to(t.device))

    def _check_state(self, state):
        """Refuse a state that is not ``{"params": {...}, "buffers": {...}}`` of the module's names: a
        name the module does not have would be ignored, and its own tensor used (zero gradients)."""
        if not isinstance(state, dict) or not set(state) <= {"params", "buffers"} or \
                not all(isinstance(v, dict) for v in state.values()):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise TypeError(f"functionalize: the state must be {{'params': {{name: array}}, 'buffers': {{name: "
                            f"array}}}} as functionalize returned it, got {got}")
        for kind, named in (("params", self.module.named_parameters), ("buffers", self.module.named_buffers)):
            known = self._names.get(kind, frozenset())
            if not known.issuperset(state.get(kind, ())):  # (the module's names are read again only then)
                known = self._names[kind] = {n for n, _ in named(remove_duplicate=False)}
            if unknown := set(state.get(kind, ())) - known:
                raise KeyError(f"functionalize: state[{kind!r}] names {sorted(unknown)[:5]}, which "
                               f"{type(self.module).__name__} does not have; its names are those of "
                               f"module.named_{'parameters' if kind == 'params' else 'buffers'}()")


def _state_tensor(kind: str, name: str, a):
    """State entry ``state[kind][name]`` as the tensor the module's forward gets."""
    if not isinstance(a, (jax.Array, jax.core.Tracer, np.ndarray)) or _is_key(a):
        hint = " (t2j.jax_view(tensor) is its jax array)" if isinstance(a, torch.Tensor) else ""
        raise TypeError(f"functionalize: state[{kind!r}][{name!r}] is a {type(a).__name__}; the state holds jax "
                        f"arrays, as functionalize returns it{hint}")
    return _to_torch(a)


def functionalize(module: torch.nn.Module):
    """``fn, state = functionalize(module)``: a pure function of a state pytree.

    ``state`` is ``{"params": {name: jax.Array}, "buffers": {name: jax.Array}}``
    (a weight shared by two submodules appears once and stays shared).
    ``fn(state, *args, rng=None, **kwargs)`` runs the module's forward on jax
    arrays and returns jax arrays; use it under `jax.jit`, `jax.grad`, `jax.vmap`
    and `jax.lax.scan`. The module's train/eval mode applies; random ops
    (dropout) draw from ``rng``, a JAX key, which is required under a JAX
    transform. ``fn.apply(state, ...)`` also returns the updated state (new
    BatchNorm running statistics in train mode). ``jax.jit(fn)`` compiles the
    mode the module had at its trace: jit again after ``module.eval()``.
    ``state`` shares the module's arrays: a step that donates it leaves the
    module without values until ``fn.write_back(new_state)``.

    >>> fn, state = t2j.functionalize(torch.nn.Linear(4, 2))
    >>> y = jax.jit(fn)(state, jnp.ones((3, 4)))
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"functionalize: module must be a torch.nn.Module, got {type(module).__name__}; a torch "
                        "function is a JAX one through t2j.jax_view(fn) or t2j.call_torch(fn, *args)")
    params = {name: _to_jax(p.detach()) for name, p in module.named_parameters()}
    buffers = {name: _to_jax(b) for name, b in module.named_buffers()}
    return Functional(module), {"params": params, "buffers": buffers}
