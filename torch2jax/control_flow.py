"""Loops, branches and remat for torch code, lowered to `jax.lax`.

``t2j.scan``, ``fori_loop``, ``while_loop``, ``cond`` and ``checkpoint`` take
functions over torch tensors. Each runs as one JAX primitive (``lax.scan``,
``lax.while_loop``, ``lax.cond``, ``jax.checkpoint``), eagerly or inside
`t2j.jit`, and is one node of torch autograd whose backward is the JAX VJP —
so ``loss.backward()`` reaches the tensors the body closes over (module
parameters) as well as its explicit inputs.

State the body touches is handled as in `t2j.jit`: tensors it closes over
(parameters and buffers of modules it can reach, captured tensors, and any
other tensor it reads, found by tracing) are inputs of the JAX program; those
it writes (BatchNorm running statistics, counters) are carried through the loop
and written back after it; dropout draws from a key carried through the loop.

`scan_layers` runs a list of identical modules as one ``lax.scan`` over their
stacked parameters, so a deep model traces and compiles one layer.

Example::

    def body(h, x):
        h = torch.tanh(cell(x) + h)
        return h, h

    h, hs = t2j.scan(body, h0, xs)          # xs: (time, batch, features)
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import torch
import torch.utils.checkpoint
import torch.utils._pytree as torch_pytree

from jax.extend.core import jaxpr_as_fun
from jax.extend.core import primitives as _prims

from . import dispatch as _dispatch
from . import gradcut as _gradcut
from . import symbolic as _sym
from . import tensor as _tensor
from .env import default_rng as _rng
from .interop import _torch_context, differentiable_vjp, torch_pullback, zero_cotangent
from .jit import _Capture, _find_roots, _inputs_reaching, _Retrace
from .tensor import Tensor, jax_array, new_tensor


class ControlFlowError(RuntimeError):
    """A body cannot be lowered to a JAX loop or branch; the message says why."""


# ---------------------------------------------------------------------------
# torch values <-> flat arrays
# ---------------------------------------------------------------------------


def _flatten(tree):
    leaves, spec = torch_pytree.tree_flatten(tree)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    return leaves, spec, tensors


def _on_host(*trees) -> bool:
    """Whether the tensors among ``trees`` are all torch's own (CPU) tensors, none on the jax
    device: the loop or branch then runs as the torch code it stands for (`_host_scan`...), its
    results on their device and its backward torch's, as for a model that runs on either device."""
    tensors = [x for x in torch_pytree.tree_leaves(trees) if isinstance(x, torch.Tensor)]
    return bool(tensors) and not any(isinstance(x, Tensor) for x in tensors)


def _host_scan(fn, init, xs, length, reverse):
    """`scan` as a Python loop over torch tensors."""
    xs_leaves, xs_spec = torch_pytree.tree_flatten(xs)
    sizes = {len(x) for x in xs_leaves if isinstance(x, torch.Tensor)}
    if length is not None:
        sizes.add(length)
    if len(sizes) != 1:
        raise ControlFlowError(f"t2j.scan: xs' leading sizes and length must agree, got {sorted(sizes)}")
    (n,) = sizes
    carry, ys = init, []
    for i in (reversed(range(n)) if reverse else range(n)):
        x = torch_pytree.tree_unflatten([a[i] if isinstance(a, torch.Tensor) else a for a in xs_leaves], xs_spec)
        carry, y = fn(carry, x)
        ys.append(y)
    if reverse:
        ys.reverse()
    if not ys:
        raise ControlFlowError("t2j.scan: an empty scan over CPU tensors has no output to stack; give it steps")
    flat = [torch_pytree.tree_flatten(y)[0] for y in ys]
    stacked = [torch.stack(col) if isinstance(col[0], torch.Tensor) else col[0] for col in zip(*flat)]
    return carry, torch_pytree.tree_unflatten(stacked, torch_pytree.tree_flatten(ys[0])[1])


def _arrays(leaves, positions):
    out = []
    for i in positions:
        t = leaves[i]
        if isinstance(t, Tensor):
            if _tensor.CAPTURE is not None:
                _tensor.CAPTURE.read(t)
            out.append(t._value())
        else:
            out.append(jax_array(t))
    return out


def _rebuild(leaves, spec, positions, arrays):
    filled = list(leaves)
    for i, a in zip(positions, arrays):
        filled[i] = new_tensor(a)
    return torch_pytree.tree_unflatten(filled, spec)


class _Structure:
    """The torch pytree structure of a body's output, learned while tracing it."""

    def __init__(self):
        self.spec = None
        self.leaves = None
        self.positions = None

    def flatten(self, tree, what):
        leaves, spec, positions = _flatten(tree)
        static = [None if i in positions else x for i, x in enumerate(leaves)]
        if self.spec is not None and (spec != self.spec or positions != self.positions):
            raise ControlFlowError(f"t2j: {what} changed structure: {self.spec} -> {spec}")
        self.spec, self.leaves, self.positions = spec, static, positions
        return [leaves[i]._value() if isinstance(leaves[i], Tensor) else jax_array(leaves[i]) for i in positions]

    def unflatten(self, arrays):
        return _rebuild(self.leaves, self.spec, self.positions, arrays)


# ---------------------------------------------------------------------------
# closed-over state
# ---------------------------------------------------------------------------


def _representative(t: Tensor) -> Tensor:
    """A base tensor (no view chain) with ``t``'s storage: what autograd differentiates."""
    if not t._t2j_view:
        return t
    base = t._base
    if isinstance(base, Tensor) and base._t2j_storage is t._t2j_storage and not base._t2j_view:
        return base
    raise ControlFlowError(
        "t2j: the body reads a view of a tensor it does not receive and whose base is unknown; pass the tensor "
        "as an explicit input"
    )


class _State:
    """Tensors a body closes over: their storages are inputs of the JAX program;
    the ones the body writes are carried through the loop and written back."""

    def __init__(self, fn):
        roots = _find_roots(fn, (), {})
        tensors = list(roots.tensors)
        for m in roots.modules:
            tensors += [p for p in m.parameters()] + [b for b in m.buffers()]
        self.tensors = []
        self.written: list = []
        self._ids = set()
        self.add([t for t in tensors if isinstance(t, Tensor)])

    def add(self, tensors):
        for t in tensors:
            t = _representative(t)
            if id(t._t2j_storage) not in self._ids:
                self._ids.add(id(t._t2j_storage))
                self.tensors.append(t)

    @property
    def storages(self):
        return [t._t2j_storage for t in self.tensors]

    def arrays(self):
        outer = _tensor.CAPTURE
        if outer is not None:
            for t in self.tensors:
                outer.read(t)
        return [t._t2j_storage.array for t in self.tensors]


class _BodyCapture(_Capture):
    """A jit trace's capture, except that a tensor holding a tracer of an enclosing trace
    (a jitted step's parameter read by a checkpointed block or a loop body) is unknown
    too: added to the state, it is an input of the body's program and gets its gradient,
    where a closed-over tracer would be a constant to torch's autograd."""

    def read(self, t):
        st = t._t2j_storage
        if id(st) not in self.inputs and st not in self.new:
            self.unknown[id(st)] = t
            self.originals.setdefault(id(st), (st, st.array))


class _Installed:
    """Within the block, the state's storages hold the given arrays (tracers of the
    body); a read of any other tensor the body did not create is recorded and ends
    the attempt (`_with_state` then adds that tensor to the state)."""

    def __init__(self, state: _State, arrays):
        self.state, self.arrays = state, arrays

    def __enter__(self):
        self.saved = [(st, st.array) for st in self.state.storages]
        for st, a in zip(self.state.storages, self.arrays):
            st.array = a
            st.version += 1
        self.outer = _tensor.CAPTURE
        self.capture = _tensor.CAPTURE = _BodyCapture(self.state.storages)
        return self

    def new_values(self):
        return [st.array for st in self.state.storages]

    def __exit__(self, *exc):
        _tensor.CAPTURE = self.outer
        for st, a in self.saved:
            st.array = a
            st.version += 1
        self.capture.restore()
        if exc[0] is None and self.capture.unknown:
            raise _Retrace(list(self.capture.unknown.values()))


class _NeedCarry(Exception):
    """The body wrote state tensors that are not carried yet (``indices`` into the state)."""

    def __init__(self, indices):
        self.indices = indices


def _with_state(fn, attempt):
    """Run ``attempt(state)``; when the body read tensors that are not yet state, or
    wrote state that is not carried, extend the state and try again."""
    state = _State(fn)
    for _ in range(6):
        try:
            return attempt(state)
        except _Retrace as r:
            state.add(r.found)
        except _NeedCarry as e:
            state.written.extend(state.tensors[i]._t2j_storage for i in e.indices)
    raise ControlFlowError("t2j: the body keeps reading new tensors; pass them as explicit inputs")


def _carried(state):
    written = {id(s) for s in state.written}
    return [i for i, t in enumerate(state.tensors) if id(t._t2j_storage) in written]


def _run_body(state, values, carried, key, call, loop=False):
    """Trace ``call()`` (torch code) with the state holding ``values``; returns its
    result, the new values of the carried state and the key after its draws. ``loop``:
    a loop's body, whose draws from explicit generators differ from iteration to iteration."""
    _rng.loop_bodies += loop
    places = _sym.PLACES
    before = places.moved() if places is not None else None
    try:
        with _Installed(state, values) as inst, _torch_context(), _rng.traced_key(key) as rng:
            result = call()
            after = inst.new_values()
    finally:
        _rng.loop_bodies -= loop
    # (a value the JAX transform traced would escape it: what was there is put back)
    if places is not None and (stored := places.put_back_since(before)):
        raise BodyStores(
            f"t2j.jit: a loop body or checkpointed block stores a tensor or traced number in Python state "
            f"({type(stored[0][0]).__name__} {stored[0][1]!r}, e.g. ``self.calls += 1``), which its JAX transform "
            "cannot carry out; return the value from the block instead")
    newly = [i for i, (a, b) in enumerate(zip(values, after)) if a is not b and i not in carried]
    if newly:
        raise _NeedCarry(newly)
    return result, [after[i] for i in carried], rng.key


class BodyStores(_dispatch.OpError):
    """A body traced by a JAX transform inside t2j.jit stored a value in Python state (`_run_body`): the
    jitted function runs eagerly (a graph break), or torch's checkpoint runs in the trace instead."""


def _write_back(state, carried, arrays):
    """After a loop: the state tensors the body wrote get their final values."""
    for i, new in zip(carried, arrays):
        t = state.tensors[i]
        if t.requires_grad:
            raise ControlFlowError(
                "t2j: the body writes in place to a tensor it closes over that requires grad; pass it through the "
                "carry instead"
            )
        st = t._t2j_storage
        st.array = new._value()
        st.version += 1


# ---------------------------------------------------------------------------
# one torch autograd node around a JAX program
# ---------------------------------------------------------------------------


def _value(t):
    if isinstance(t, Tensor):
        return t._value()
    return jax_array(t)


class _Program(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *tensors):
        arrays = [_value(t) for t in tensors]
        diff = [t.requires_grad and (t.is_floating_point() or t.is_complex()) for t in tensors]
        ctx.diff = diff
        ctx.inputs = [t for t, m in zip(tensors, diff) if m]

        def primal(*d):
            it = iter(d)
            return run([next(it) if m else a for a, m in zip(arrays, diff)])

        with jax.enable_x64(True):
            # traced once, as a jaxpr: it tells which inputs reach an output. State the body can
            # reach but does not use (a closed-over module's other parameters) gets no gradient,
            # None, as in torch, not zeros an optimizer's weight decay would act on
            primals = [a for a, m in zip(arrays, diff) if m]
            closed = jax.make_jaxpr(primal)(*primals)
            outs, ctx.vjp = jax.vjp(jaxpr_as_fun(closed), *primals)
        ctx.reaching = _inputs_reaching(closed.jaxpr, range(len(outs)))
        ctx.primal = primal
        ctx.avals = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
        return tuple(new_tensor(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        if _gradcut.creates_graph((*ctx.inputs, *grads)):
            got = differentiable_vjp(lambda ps, cs: jax.vjp(ctx.primal, *ps)[1](cs), ctx.inputs, grads, ctx.avals)
        else:
            cot = [zero_cotangent(a) if g is None else _value(g) for g, a in zip(grads, ctx.avals)]
            with jax.enable_x64(True):
                got = [new_tensor(g) for g in torch_pullback(lambda _, c: ctx.vjp(c), None, cot)]
        got = iter(g if i in ctx.reaching else None for i, g in enumerate(got))
        return (None, *[next(got) if m else None for m in ctx.diff])


def _apply(run, tensors):
    """``run(arrays) -> list of arrays`` as one torch autograd node over ``tensors``."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_Program.apply(_as_caller(run), *tensors))
    with jax.enable_x64(True):
        return [new_tensor(o) for o in run([_value(t) for t in tensors])]


def _as_caller(run):
    """``run`` as the caller would run it, not as a Function's forward (`gradcut.as_caller`)."""

    def run_as_caller(arrays):
        with _gradcut.as_caller():
            return run(arrays)

    return run_as_caller


def _check_carry(what, before, after):
    for i, (a, b) in enumerate(zip(before, after)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ControlFlowError(
                f"t2j.{what}: the body changed carry leaf {i} from {a.dtype}{list(a.shape)} to "
                f"{b.dtype}{list(b.shape)}; a loop carry must keep its shape and dtype"
            )


def _rewrap(structure, tensors):
    filled = list(structure.leaves)
    for i, t in zip(structure.positions, tensors):
        filled[i] = t
    return torch_pytree.tree_unflatten(filled, structure.spec)


# ---------------------------------------------------------------------------
# scan, fori_loop, while_loop, cond
# ---------------------------------------------------------------------------


def scan(fn, init, xs=None, length: int | None = None, reverse: bool = False, unroll: int = 1):
    """``lax.scan`` for torch: ``fn(carry, x) -> (carry, y)`` over the leading axis of ``xs``.

    ``init`` and ``xs`` are tensors or pytrees of them (``xs`` may be None when
    ``length`` is given). Returns ``(carry, ys)`` with the ``y``s stacked. The carry
    must keep its shapes and dtypes. Differentiable with respect to ``init``,
    ``xs`` and the tensors ``fn`` closes over.

    >>> h, hs = t2j.scan(lambda h, x: (h * 0.9 + x, h), torch.zeros(3, device="jax"), xs)
    """
    if _on_host(init, xs):
        return _host_scan(fn, init, xs, length, reverse)
    init_leaves, init_spec, init_pos = _flatten(init)
    xs_leaves, xs_spec, xs_pos = _flatten(xs)
    n_init, n_xs = len(init_pos), len(xs_pos)
    key = _rng.body_key()

    def attempt(state):
        carry_out, ys = _Structure(), _Structure()
        carried = _carried(state)

        def run(arrays):
            init_a, xs_a, state_a = arrays[:n_init], arrays[n_init:n_init + n_xs], arrays[n_init + n_xs:]

            def body(c, x):
                user_c, carried_c, k = c
                values = list(state_a)
                for i, v in zip(carried, carried_c):
                    values[i] = v

                def call():
                    new_carry, y = fn(_rebuild(init_leaves, init_spec, init_pos, user_c),
                                      _rebuild(xs_leaves, xs_spec, xs_pos, x if n_xs else ()))
                    return carry_out.flatten(new_carry, "scan carry"), ys.flatten(y, "scan output")

                (new_c, y_a), carried_new, k = _run_body(state, values, carried, k, call, loop=True)
                _check_carry("scan", user_c, new_c)
                return (new_c, carried_new, k), y_a

            c0 = (list(init_a), [state_a[i] for i in carried], key)
            (c, s, _), y = jax.lax.scan(body, c0, list(xs_a) if n_xs else None, length=length, reverse=reverse,
                                        unroll=unroll)
            return [*c, *y, *s]

        outs = _apply(run, [init_leaves[i] for i in init_pos] + [xs_leaves[i] for i in xs_pos] + state.tensors)
        n_c, n_y = len(carry_out.positions), len(ys.positions)
        _write_back(state, carried, outs[n_c + n_y:])
        return _rewrap(carry_out, outs[:n_c]), _rewrap(ys, outs[n_c:n_c + n_y])

    return _with_state(fn, attempt)


def fori_loop(lower: int, upper: int, body, init):
    """``lax.fori_loop`` for torch: ``body(i, carry) -> carry`` for ``i`` in ``[lower, upper)``
    (``i`` is a 0-d int64 tensor). Differentiable (it is a scan over the trip count).

    >>> x = t2j.fori_loop(0, 10, lambda i, x: x * 0.5 + i, torch.ones(3, device="jax"))
    """
    if _on_host(init):
        carry = init
        for i in range(lower, upper):
            carry = body(torch.tensor(i), carry)
        return carry
    steps = torch.arange(lower, upper, device=_tensor.DEVICE)
    carry, _ = scan(lambda c, i: (body(i, c), None), init, steps)
    return carry


def while_loop(cond_fn, body_fn, init):
    """``lax.while_loop`` for torch: repeat ``carry = body_fn(carry)`` while
    ``cond_fn(carry)`` (a bool tensor) holds. Not differentiable (as in JAX).

    >>> n = t2j.while_loop(lambda x: x < 100, lambda x: x * 2, torch.tensor(1, device="jax"))
    """
    if _on_host(init):
        carry = init
        while bool(cond_fn(carry)):
            carry = body_fn(carry)
        return carry
    leaves, spec, pos = _flatten(init)
    key = _rng.body_key()

    def attempt(state):
        carry_out = _Structure()
        carried = _carried(state)
        state_a = state.arrays()

        def values_of(carried_c):
            values = list(state_a)
            for i, v in zip(carried, carried_c):
                values[i] = v
            return values

        def cond(c):
            user_c, carried_c, k = c

            def call():
                flag = cond_fn(_rebuild(leaves, spec, pos, user_c))
                return _value(flag) if isinstance(flag, torch.Tensor) else jax.numpy.asarray(flag)

            flag, _, _ = _run_body(state, values_of(carried_c), carried, k, call)
            return flag.astype(bool).reshape(())

        def body(c):
            user_c, carried_c, k = c

            def call():
                return carry_out.flatten(body_fn(_rebuild(leaves, spec, pos, user_c)), "while_loop carry")

            new_c, carried_new, k = _run_body(state, values_of(carried_c), carried, k, call, loop=True)
            _check_carry("while_loop", user_c, new_c)
            return new_c, carried_new, k

        with jax.enable_x64(True), torch.no_grad():
            c, s, _ = jax.lax.while_loop(cond, body, (_arrays(leaves, pos), [state_a[i] for i in carried], key))
            outs = [new_tensor(a) for a in [*c, *s]]
        _write_back(state, carried, outs[len(c):])
        return _rewrap(carry_out, outs[:len(c)]) if carry_out.spec is not None else init

    return _with_state(body_fn, attempt)


def cond(pred, true_fn, false_fn, *operands):
    """``lax.cond`` for torch: ``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``,
    both traced, one of them run. ``pred`` is a bool tensor (traced under jit) or a
    Python bool. Both branches must return the same structure, shapes and dtypes.
    Differentiable with respect to the operands and closed-over tensors.

    >>> y = t2j.cond(x.sum() > 0, lambda x: x * 2, lambda x: -x, x)
    """
    if _on_host(pred, operands):
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    leaves, spec, pos = _flatten(operands)
    key = _rng.body_key()

    def both(*fns):
        return lambda *a, **k: [f(*a, **k) for f in fns]

    def attempt(state):
        outs_struct = [_Structure(), _Structure()]
        carried = _carried(state)

        def run(arrays):
            p, ops_a, state_a = arrays[0], arrays[1:1 + len(pos)], arrays[1 + len(pos):]

            def branch(k, fn):
                def f(ops_a, state_a):
                    def call():
                        return outs_struct[k].flatten(fn(*_rebuild(leaves, spec, pos, ops_a)), "cond branch")

                    out, new_state, _ = _run_body(state, list(state_a), carried, key, call)
                    return out, new_state

                return f

            out, new_state = jax.lax.cond(p.astype(bool).reshape(()), branch(0, true_fn), branch(1, false_fn),
                                          list(ops_a), list(state_a))
            return [*out, *new_state]

        pred_t = pred if isinstance(pred, torch.Tensor) else torch.tensor(bool(pred))
        outs = _apply(run, [pred_t] + [leaves[i] for i in pos] + state.tensors)
        n = len(outs_struct[0].positions)
        _write_back(state, carried, outs[n:])
        return _rewrap(outs_struct[0], outs[:n])

    return _with_state(both(true_fn, false_fn), attempt)


# ---------------------------------------------------------------------------
# scan_layers and checkpoint
# ---------------------------------------------------------------------------


def _transposed_operand(a, dims, sources):
    """``a`` itself, or the matrix it transposes with ``dims`` renumbered to index it."""
    src = sources.get(id(a))
    if src is None:
        return a, dims
    return src, tuple(1 - d for d in dims)


def _eval_folding_transposes(jaxpr, consts, args):
    """Evaluate ``jaxpr``, feeding each matrix transpose that a dot consumes to the dot
    itself (as contracting dimensions), so the program has no transpose to materialize.

    torch's ``Linear`` multiplies by ``weight.t()``: in a loop body XLA:CPU copies that
    transpose on every iteration, where in straight-line code it folds it into the dot.
    """
    env, sources = {}, {}

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        params = eqn.params
        if eqn.primitive is _prims.dot_general_p and params["dimension_numbers"][1] == ((), ()):
            (lc, rc), batch = params["dimension_numbers"]
            lhs, lc = _transposed_operand(invals[0], lc, sources)
            rhs, rc = _transposed_operand(invals[1], rc, sources)
            invals, params = [lhs, rhs], dict(params, dimension_numbers=((lc, rc), batch))
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        outs = out if eqn.primitive.multiple_results else [out]
        if eqn.primitive is _prims.transpose_p and params["permutation"] == (1, 0):
            sources[id(outs[0])] = invals[0]
        elif eqn.primitive is _prims.stop_gradient_p and id(invals[0]) in sources:
            # a transposed weight read under no_grad (torch2jax/gradcut.py)
            sources[id(outs[0])] = jax.lax.stop_gradient(sources[id(invals[0])])
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _folding_transposes(fn):
    """``fn`` (a JAX function), traced once and evaluated by `_eval_folding_transposes`."""

    def folded(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _eval_folding_transposes(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return folded


def scan_layers(layers, hidden, *args, remat=None, **kwargs):
    """Run same-structure modules one after another as a single ``lax.scan``.

    ``layers`` is an ``nn.ModuleList`` (or sequence) of modules with identical
    parameter names, shapes and dtypes; each is called as
    ``layer(hidden, *args, **kwargs)`` and returns the next ``hidden`` (or a tuple
    whose first element it is). Their parameters are stacked and the first layer
    is traced once for all of them, so a deep model compiles one layer. Gradients
    reach every layer's own parameters; buffers the layers update are written
    back per layer. ``remat`` rematerializes each layer in the backward pass:
    ``True``, or a JAX checkpoint policy (``jax.checkpoint_policies.dots_saveable``).

    >>> h = t2j.scan_layers(model.blocks, h)            # instead of: for b in model.blocks: h = b(h)
    """
    if not isinstance(layers, _ScannedModuleList) and _on_host(hidden, args, kwargs,
                                                               [list(layer.parameters()) for layer in layers]):
        for layer in layers:
            out = layer(hidden, *args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden
    if isinstance(layers, _ScannedModuleList):  # already converted by use_scan_layers
        return _scan_layers(layers._modules.values(), hidden, args, kwargs, remat, layers._stacked_parameters())[0]
    return _scan_layers(layers, hidden, args, kwargs, remat)[0]


def _scan_layers(layers, hidden, args, kwargs, remat, stacked=None):
    """`scan_layers`, also telling whether a layer returns a tuple (HF layers do).
    ``stacked`` maps parameter names to the layers' stacked parameters when they
    are stored stacked (`use_scan_layers(..., stack_parameters=True)`)."""
    layers = list(layers)
    if not layers:
        return hidden, False
    template = layers[0]
    on_list = stacked or {}
    pnames = list(on_list) + [n for n, _ in template.named_parameters()]
    bnames = [n for n, _ in template.named_buffers()]
    per_layer = []
    for k, layer in enumerate(layers):
        params = {n: on_list[n][k] for n in on_list}
        params.update(layer.named_parameters())
        buffers = dict(layer.named_buffers())
        if list(params) != pnames or list(buffers) != bnames:
            raise ControlFlowError(
                f"t2j.scan_layers: layer {k} ({type(layer).__name__}) does not have the parameters and buffers of "
                f"layer 0 ({type(template).__name__}); all layers must have the same structure"
            )
        first = per_layer[0] if per_layer else [params[n] for n in pnames] + [buffers[n] for n in bnames]
        for n, a, b in zip(pnames + bnames, [params[n] for n in pnames] + [buffers[n] for n in bnames], first):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ControlFlowError(
                    f"t2j.scan_layers: {n} of layer {k} is {a.dtype}{list(a.shape)} but {b.dtype}{list(b.shape)} in "
                    "layer 0; all layers must have the same shapes"
                )
        per_layer.append([params[n] for n in pnames] + [buffers[n] for n in bnames])
    n_p, n_b = len(pnames), len(bnames)
    leaves, spec, pos = _flatten(((hidden, *args), kwargs))
    key = _rng.body_key()
    policy = None if remat is True else remat
    if remat is False:
        remat = None
    kind = {}

    def attempt(state):
        out_struct = _Structure()
        carried = _carried(state)
        n_in = len(pos)

        def run(arrays):
            inputs = arrays[:n_in]
            stacked = arrays[n_in:n_in + n_p + n_b]
            state_a = arrays[n_in + n_p + n_b:]

            def body(c, xs):
                h, carried_c, k = c
                values = list(state_a)
                for i, v in zip(carried, carried_c):
                    values[i] = v
                layer_inputs = [h, *inputs[1:]]

                def call():
                    (hid, *rest), kw = _rebuild(leaves, spec, pos, layer_inputs)
                    tensors = {n: new_tensor(a) for n, a in zip(pnames + bnames, xs)}
                    with _StackedSlices(template, {n: tensors.pop(n) for n in on_list}):
                        out = torch.func.functional_call(template, tensors, (hid, *rest), kw, tie_weights=False,
                                                         strict=True)
                    new_h = out if isinstance(out, torch.Tensor) else out[0]
                    kind["tuple"] = not isinstance(out, torch.Tensor)
                    return out_struct.flatten(new_h, "layer output"), [tensors[n]._value() for n in bnames]

                (new_h, new_bufs), carried_new, k = _run_body(state, values, carried, k, call, loop=True)
                _check_carry("scan_layers", [h], new_h)
                return (new_h[0], carried_new, k), new_bufs

            body = _folding_transposes(body)
            if remat is not None:
                body = jax.checkpoint(body, policy=policy, prevent_cse=False)
            (h, s, _), bufs = jax.lax.scan(body, (inputs[0], [state_a[i] for i in carried], key), stacked)
            return [h, *bufs, *s]

        # Stacked in torch, so that torch autograd unstacks the gradients: each layer's
        # .grad is then a view of one stacked gradient, and the program has no
        # per-layer slices of its own (each would be a kernel of its own to compile).
        whole = [on_list[n] if n in on_list else torch.stack([layer[j] for layer in per_layer])
                 for j, n in enumerate(pnames + bnames)]
        outs = _apply(run, [leaves[i] for i in pos] + whole + state.tensors)
        for j, name in enumerate(bnames):
            for k, layer in enumerate(layers):
                st = per_layer[k][n_p + j]._t2j_storage
                st.array = outs[1 + j]._value()[k]
                st.version += 1
        _write_back(state, carried, outs[1 + n_b:])
        return outs[0], kind.get("tuple", False)

    return _with_state(template, attempt)


def checkpoint(fn, *, policy=None):
    """Rematerialize ``fn`` in the backward pass (``jax.checkpoint`` for torch code):
    its intermediate results are recomputed rather than saved, except those the JAX
    checkpoint ``policy`` saves (e.g. ``jax.checkpoint_policies.dots_saveable``).

    >>> block = t2j.checkpoint(block)          # block(x) now saves only its inputs
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if _on_host(args, kwargs):  # (the policy is JAX's: torch's checkpoint saves nothing)
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
        leaves, spec, pos = _flatten((args, kwargs))
        # the block draws from the head of the generator's stream, which then skips its draws:
        # its dropout masks are the plain block's under the same seed, as torch's checkpoint
        # runs the forward on the global generator
        key = _rng.stream_key()
        draws = [0]

        def attempt(state):
            out_struct = _Structure()
            carried = _carried(state)

            def run(arrays):
                inputs, state_a = arrays[:len(pos)], arrays[len(pos):]

                def f(inputs, state_a):
                    def call():
                        a, k = _rebuild(leaves, spec, pos, inputs)
                        out = out_struct.flatten(fn(*a, **k), "checkpointed output")
                        draws[0] = _rng.draws
                        return out

                    out, new_state, _ = _run_body(state, list(state_a), carried, key, call)
                    return out, new_state

                out, new_state = jax.checkpoint(f, policy=policy)(list(inputs), list(state_a))
                return [*out, *new_state]

            outs = _apply(run, [leaves[i] for i in pos] + state.tensors)
            n = len(out_struct.positions)
            _write_back(state, carried, outs[n:])
            return _rewrap(out_struct, outs[:n])

        result = _with_state(fn, attempt)
        _rng.skip(draws[0])
        return result

    return wrapped


class _ScanAll:
    """What iterating a scanned layer list yields: one callable running every layer."""

    def __init__(self, layers, remat, stacked=None):
        self.layers, self.remat, self.stacked = layers, remat, stacked

    def __call__(self, hidden, *args, **kwargs):
        # transformers names the layers' cache argument past_key_value(s), layer_past or (from 5.x) cache
        cache = any(kwargs.get(k) is not None for k in _CACHE_ARGUMENTS)
        off_device = self.stacked and not isinstance(hidden, Tensor)
        if cache or any(_is_cache(a) for a in (*args, *kwargs.values())) or off_device:
            # per-layer caches are Python objects indexed by layer, and stacked layers off the
            # jax device read their slices: run the layers one by one
            out = None
            for layer in self.layers:
                out = layer(hidden, *args, **kwargs)
                hidden = out if isinstance(out, torch.Tensor) else out[0]
            return out
        h, as_tuple = _scan_layers(self.layers, hidden, args, kwargs, self.remat, self.stacked)
        return (h,) if as_tuple else h


_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past", "cache")


def _is_cache(x):
    return type(x).__name__.endswith("Cache")


class _ScannedModuleList(torch.nn.ModuleList):
    """A ModuleList whose iteration runs all its layers as one `scan_layers`."""

    _t2j_remat = None
    _t2j_stacked = None  # layer parameter name -> name of the stacked Parameter on this list

    def _stacked_parameters(self):
        if not self._t2j_stacked:
            return None
        return {n: self._parameters[key] for n, key in self._t2j_stacked.items()}

    def __iter__(self):
        return iter([_ScanAll(list(self._modules.values()), self._t2j_remat, self._stacked_parameters())])

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            layers = list(self._modules.values())
            stacked = self._stacked_parameters()
            if stacked:
                stacked = {n: p[idx] for n, p in stacked.items()}
            return [_ScanAll(layers[idx], self._t2j_remat, stacked)]
        return super().__getitem__(idx)


# -- layers whose parameters are stored stacked --------------------------------------


class _StackedAccess:
    """Mixed into the class of a module whose parameters were moved into a stacked
    Parameter: reading ``module.weight`` gives its layer's slice of the stack (a
    view, so autograd reaches the stack), or inside the scan the slice being run."""

    def __getattr__(self, name):
        refs = self.__dict__.get("_t2j_stacked_refs")
        if refs is not None and name in refs:
            override = self.__dict__.get("_t2j_slices")
            if override is not None and name in override:
                return override[name]
            owner, key, index = refs[name]
            return owner._parameters[key][index]
        return super().__getattr__(name)


@functools.lru_cache(maxsize=None)
def _with_stacked_access(cls):
    return type(cls.__name__, (_StackedAccess, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _owner(module, name):
    path, _, leaf = name.rpartition(".")
    return module.get_submodule(path), leaf


class _StackedSlices:
    """Within the block, ``layer``'s stacked parameters read as the given tensors."""

    def __init__(self, layer, slices):
        self.layer, self.slices = layer, slices

    def __enter__(self):
        self.set = []
        for name, t in self.slices.items():
            sub, leaf = _owner(self.layer, name)
            sub.__dict__.setdefault("_t2j_slices", {})[leaf] = t
            self.set.append((sub, leaf))

    def __exit__(self, *exc):
        for sub, leaf in self.set:
            sub.__dict__["_t2j_slices"].pop(leaf, None)


def _stack_parameters(layers: _ScannedModuleList):
    """Move the layers' parameters into one stacked Parameter per name, registered
    on ``layers``; the layers read their slices (`_StackedAccess`), and the state
    dict keeps the per-layer names (``layers.3.attn.weight``)."""
    modules = list(layers._modules.values())
    names = [n for n, _ in modules[0].named_parameters()]
    for k, m in enumerate(modules):
        if [n for n, _ in m.named_parameters()] != names:
            raise ControlFlowError(f"t2j.use_scan_layers: layer {k} does not have the parameters of layer 0; "
                                   "stack_parameters needs layers of the same structure")
    every = [p for m in modules for _, p in m.named_parameters(remove_duplicate=False)]
    if len({id(p) for p in every}) != len(every):
        raise ControlFlowError("t2j.use_scan_layers: stack_parameters cannot stack layers with tied parameters")
    keys = {}
    for name in names:
        values = [dict(m.named_parameters())[name] for m in modules]
        key = "stacked_" + name.replace(".", "__")
        with torch.no_grad():
            stacked = torch.nn.Parameter(torch.stack([v.detach() for v in values]),
                                         requires_grad=values[0].requires_grad)
        layers.register_parameter(key, stacked)
        keys[name] = key
        for k, m in enumerate(modules):
            sub, leaf = _owner(m, name)
            del sub._parameters[leaf]
            if not isinstance(sub, _StackedAccess):
                sub.__class__ = _with_stacked_access(type(sub))
            sub.__dict__.setdefault("_t2j_stacked_refs", {})[leaf] = (layers, key, k)
    layers._t2j_stacked = keys
    layers._register_state_dict_hook(_per_layer_state_dict)
    layers._register_load_state_dict_pre_hook(_stack_loaded_state_dict, with_module=True)


def _per_layer_state_dict(layers, state_dict, prefix, local_metadata):
    for name, key in layers._t2j_stacked.items():
        stacked = state_dict.pop(prefix + key)
        for k in range(stacked.shape[0]):
            state_dict[f"{prefix}{k}.{name}"] = stacked[k]
    return state_dict


def _stack_loaded_state_dict(layers, state_dict, prefix, *args):
    n = len(layers._modules)
    for name, key in layers._t2j_stacked.items():
        per_layer = [f"{prefix}{k}.{name}" for k in range(n)]
        if all(k in state_dict for k in per_layer):
            state_dict[prefix + key] = torch.stack([state_dict.pop(k) for k in per_layer])


def stacked_parameter_names(module: torch.nn.Module) -> dict:
    """For each parameter of ``module`` that holds a stack of layers' parameters
    (`use_scan_layers` with ``stack_parameters=True``), its name in ``named_parameters()`` ->
    the name of the first layer's parameter it replaces: sharding rules written for one
    layer's parameters apply to the stack's trailing dimensions.

    >>> stacked_parameter_names(model)["model.layers.stacked_mlp__up_proj__weight"]
    'model.layers.0.mlp.up_proj.weight'
    """
    out = {}
    for prefix, sub in module.named_modules():
        for name, key in (getattr(sub, "_t2j_stacked", None) or {}).items():
            where = f"{prefix}." if prefix else ""
            out[f"{where}{key}"] = f"{where}0.{name}"
    return out


def use_scan_layers(model: torch.nn.Module, *, remat=None, names=("layers", "h", "blocks", "layer"),
                    stack_parameters: bool = False):
    """Make ``model`` run its stack of identical layers with `scan_layers`, in place.

    Finds each ``nn.ModuleList`` attribute called one of ``names`` whose modules
    share one class (an HF Llama's ``model.layers``, GPT-2's ``transformer.h``,
    BERT's ``encoder.layer``) and makes ``for layer in layers: ...`` in the
    model's own forward run all of them as one ``lax.scan``. Parameters, state
    dict and optimizers are unchanged. With a KV cache (generation) the layers
    run one by one as before. Returns ``model``.

    ``stack_parameters=True`` also stores the layers' parameters as JAX models
    do: one Parameter per name holding all layers (``[n_layers, ...]``), so an
    optimizer updates a dozen tensors instead of a dozen per layer (much faster
    to compile) and the scan reads them without stacking. ``model.parameters()``
    then yields the stacked Parameters (create the optimizer afterwards);
    ``layer.attn.weight`` still reads its layer's slice, and ``state_dict()`` /
    ``load_state_dict()`` keep the per-layer names, so checkpoints are unchanged
    (save the state dict: the layers' classes are specialized, so pickling the
    whole module is not supported).

    >>> t2j.use_scan_layers(llama)     # llama.model.layers now traces one layer
    """
    found = 0
    for module in model.modules():
        for name in names:
            child = module._modules.get(name)
            if isinstance(child, torch.nn.ModuleList) and len(child) > 1 and \
                    len({type(m) for m in child}) == 1:
                child.__class__ = _ScannedModuleList
                child._t2j_remat = remat
                if stack_parameters and not child._t2j_stacked:
                    _stack_parameters(child)
                found += 1
    if not found:
        raise ControlFlowError(
            f"t2j.use_scan_layers: {type(model).__name__} has no ModuleList of identical layers named one of {names}; "
            "call t2j.scan_layers(layers, hidden, ...) in its forward instead"
        )
    return model


# ---------------------------------------------------------------------------
# torch's own higher-order ops on the jax device
# ---------------------------------------------------------------------------


def _on_jax(*trees) -> bool:
    return any(isinstance(x, Tensor) for x in torch_pytree.tree_leaves(trees))


def _torch_cond(original):
    @functools.wraps(original)
    def torch_cond(pred, true_fn, false_fn, operands=()):
        if not _on_jax(pred, operands):
            return original(pred, true_fn, false_fn, operands)
        return cond(pred, true_fn, false_fn, *operands)

    return torch_cond


def _torch_while_loop(original):
    @functools.wraps(original)
    def torch_while_loop(cond_fn, body_fn, carried_inputs):
        if not _on_jax(carried_inputs):
            return original(cond_fn, body_fn, carried_inputs)
        carried = tuple(carried_inputs)
        return tuple(while_loop(lambda c: cond_fn(*c), lambda c: tuple(body_fn(*c)), carried))

    return torch_while_loop


def _torch_scan(original):
    @functools.wraps(original)
    def torch_scan(combine_fn, init, xs, *, dim=0, reverse=False):
        if not _on_jax(init, xs):
            return original(combine_fn, init, xs, dim=dim, reverse=reverse)
        moved = torch_pytree.tree_map(lambda t: t.movedim(dim, 0) if isinstance(t, torch.Tensor) else t, xs)
        carry, ys = scan(combine_fn, init, moved, reverse=reverse)
        return carry, torch_pytree.tree_map(lambda t: t.movedim(0, dim) if isinstance(t, torch.Tensor) else t, ys)

    return torch_scan


def _torch_checkpoint(original):
    @functools.wraps(original)
    def torch_checkpoint(function, *args, use_reentrant=None, context_fn=None, **kwargs):
        # Torch's non-reentrant checkpoint recomputes the forward as torch ops in the
        # backward pass; under a trace XLA would merge that copy with the forward and
        # keep the activations. jax.checkpoint recomputes inside the program instead.
        # Eagerly torch's own checkpoint runs (forward hooks see real values, the RNG
        # state is stashed through torch.jax). The reentrant form gives closed-over
        # parameters no gradient when no input needs one, and a context_fn picks what
        # torch saves: both keep torch's path.
        default_context = context_fn is None or context_fn is torch.utils.checkpoint.noop_context_fn
        if use_reentrant is False and default_context and not _dispatch._eager() and _on_jax(args, kwargs):
            plain = {k: v for k, v in kwargs.items()
                     if k not in ("preserve_rng_state", "determinism_check", "debug", "early_stop")}
            try:
                return checkpoint(function)(*args, **plain)
            except BodyStores:  # (``self.calls += 1``: torch's recompute in the trace repeats it, as torch does)
                pass
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        return original(function, *args, use_reentrant=use_reentrant, **kwargs)

    return torch_checkpoint


def install_torch_higher_order_ops() -> None:
    """Route ``torch.cond`` and ``torch._higher_order_ops.while_loop`` / ``scan`` to
    `cond`, `while_loop` and `scan` when their inputs are on the jax device (torch's
    eager versions would send our tensors through Dynamo), and
    ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` to
    `checkpoint`. Called on import."""
    import sys

    import torch._higher_order_ops as hops

    # the package re-exports functions under its submodules' names: take the modules
    while_module = sys.modules["torch._higher_order_ops.while_loop"]
    scan_module = sys.modules["torch._higher_order_ops.scan"]

    if getattr(torch.cond, "_t2j", False):
        return
    torch.cond = _torch_cond(torch.cond)
    while_module.while_loop = hops.while_loop = _torch_while_loop(while_module.while_loop)
    scan_module.scan = hops.scan = _torch_scan(scan_module.scan)
    torch.utils.checkpoint.checkpoint = _torch_checkpoint(torch.utils.checkpoint.checkpoint)
    # transformers binds the name when it is imported; if that came first, rebind it
    hf = sys.modules.get("transformers.modeling_utils")
    if hf is not None and getattr(hf, "checkpoint", None) is not None:
        hf.checkpoint = torch.utils.checkpoint.checkpoint
    for f in (torch.cond, hops.while_loop, hops.scan, torch.utils.checkpoint.checkpoint):
        f._t2j = True
