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

`layer_scan.scan_layers` builds on these: a stack of layers as one ``lax.scan``
over their stacked parameters, so a deep model traces and compiles one layer.

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
from .device import wraps_torch_function
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
        self.block = _tensor.traced_block()
        self.block.__enter__()
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
        self.block.__exit__(*exc)
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


def _state_values(arrays, carried, carried_values):
    """The state's arrays inside a loop body: ``arrays``, with those ``carried`` (indices) replaced
    by the loop carry's ``carried_values``."""
    values = list(arrays)
    for i, v in zip(carried, carried_values):
        values[i] = v
    return values


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


def _differentiated_as(closed, primals, outs):
    """``outs``, the values of ``closed`` at ``primals`` that a `jax.vjp` in this trace computed (for
    torch's backward, `_Program`), as values that a JAX differentiation of the trace itself (a jitted
    forward differentiated outside it, a block inside another's body) differentiates with the VJP of
    ``closed``. The primal outputs of a `jax.vjp` come from its linearization, where a `jax.custom_vjp`
    inside (a custom autograd.Function) is a forward of plain ops: differentiated again, they would
    not follow its rule.

    While JAX stages the program, the value is ``outs`` itself (no second forward); a JAX
    differentiation reruns ``closed`` as its forward. The jaxpr's constants (the inputs that require
    no grad in torch's sense, the key) are arguments, differentiated too (JAX, not torch's flags,
    decides what the outer differentiation reaches), and the rerun reads no value of this trace."""
    n = len(closed.consts)
    first = [jax.lax.stop_gradient(o) for o in outs]
    staging = [_gradcut.is_staging()]

    def plain(args):
        return jaxpr_as_fun(jax.extend.core.ClosedJaxpr(closed.jaxpr, list(args[:n])))(*args[n:])

    @jax.custom_vjp
    def call(*args):
        return first if staging[0] else plain(args)

    def fwd(*args):
        return jax.vjp(lambda *a: plain(a), *args)

    def bwd(pull, cotangents):
        return pull(cotangents)

    call.defvjp(fwd, bwd)
    values = call(*closed.consts, *primals)
    staging[0] = False
    return values


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
            if _gradcut.jax_may_differentiate():
                outs = _differentiated_as(closed, primals, outs)
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
                values = _state_values(state_a, carried, carried_c)

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
            return _state_values(state_a, carried, carried_c)

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
# remat, and transposes folded into the matmuls of scanned layers
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
    torch.cond = wraps_torch_function(_torch_cond(torch.cond), traced_on_jax=True)
    while_module.while_loop = hops.while_loop = wraps_torch_function(_torch_while_loop(while_module.while_loop))
    scan_module.scan = hops.scan = wraps_torch_function(_torch_scan(scan_module.scan))
    torch.utils.checkpoint.checkpoint = _torch_checkpoint(torch.utils.checkpoint.checkpoint)
    # transformers binds the name when it is imported; if that came first, rebind it
    hf = sys.modules.get("transformers.modeling_utils")
    if hf is not None and getattr(hf, "checkpoint", None) is not None:
        hf.checkpoint = torch.utils.checkpoint.checkpoint
    for f in (torch.cond, hops.while_loop, hops.scan, torch.utils.checkpoint.checkpoint):
        f._t2j = True
