"""flax nnx and equinox modules from torch modules, and torch modules from them.

torch -> JAX:

* `to_nnx(module)`: a ``flax.nnx.Module`` whose ``nnx.Param`` variables are the
  torch module's parameters and whose ``nnx.BatchStat`` variables are its
  buffers; calling it runs the torch forward on them (`t2j.functionalize`), so
  ``nnx.grad``, ``nnx.jit`` and ``nnx.Optimizer`` train it.
* `to_equinox(module)`: an ``equinox.Module`` holding the parameters as array
  fields (buffers through ``eqx.nn.State``), for ``eqx.filter_jit`` /
  ``eqx.filter_grad`` and optax.

JAX -> torch:

* `from_nnx(nnx_module)` / `from_equinox(eqx_module)`: a ``torch.nn.Module``
  whose parameters are `torch2jax.Tensor` parameters holding the JAX module's
  arrays; its forward calls the JAX module through `t2j.call_jax`, so torch
  autograd, ``torch.optim`` and `t2j.jit` work across the boundary.
  ``.to_jax()`` returns the JAX module with the current (trained) values.

Example::

    block = t2j.modules.from_nnx(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), block).to("jax")
    model(ids).sum().backward()                   # grads reach the nnx kernel too
    trained = block.to_jax()                      # the nnx.Linear, updated in place
"""

from __future__ import annotations

import contextlib
import functools

import equinox as eqx
import jax
import torch
from flax import nnx

from .interop import Functional, call_jax, functionalize
from .tensor import Tensor, new_tensor, torch_cpu


@contextlib.contextmanager
def _training(module: torch.nn.Module, training: bool):
    # The JAX side owns the mode; the torch module's own flag is left as it was.
    modes = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _check_torch_module(fn_name: str, module) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"t2j.modules.{fn_name}: expected a torch.nn.Module, got {type(module).__name__}")


def _write_into_torch(module: torch.nn.Module, arrays: dict) -> torch.nn.Module:
    """Copy ``{name: jax.Array}`` into the module's parameters and buffers, in place."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    with torch.no_grad():
        for name, a in arrays.items():
            t = tensors[name]
            t.copy_(new_tensor(a) if isinstance(t, Tensor) else torch_cpu(a))
    return module


# ---------------------------------------------------------------------------
# torch -> flax nnx
# ---------------------------------------------------------------------------


class NnxModule(nnx.Module):
    """A torch module as a flax nnx module (see `to_nnx`)."""

    def __init__(self, module: torch.nn.Module, rngs: nnx.Rngs | None = None):
        fn, state = functionalize(module)
        self.torch_module = module
        self.functional = fn
        self.params = nnx.Dict({n: nnx.Param(a) for n, a in state["params"].items()})
        self.buffers = nnx.Dict({n: nnx.BatchStat(a) for n, a in state["buffers"].items()})
        self.rngs = rngs
        self.deterministic = not module.training

    def __call__(self, *args, **kwargs):
        state = {"params": {n: v[...] for n, v in self.params.items()},
                 "buffers": {n: v[...] for n, v in self.buffers.items()}}
        rng = self.rngs.dropout() if self.rngs is not None and not self.deterministic else None
        with _training(self.torch_module, not self.deterministic):
            out, new = self.functional.apply(state, *args, rng=rng, **kwargs)
        for name, a in new["buffers"].items():
            if a is not state["buffers"][name]:
                self.buffers[name][...] = a
        return out

    def to_torch(self) -> torch.nn.Module:
        """The torch module, its parameters and buffers overwritten (in place) with this
        module's current values.

        >>> trained_torch_model = nnx_model.to_torch()
        """
        arrays = {n: v[...] for n, v in self.params.items()}
        arrays.update({n: v[...] for n, v in self.buffers.items()})
        return _write_into_torch(self.torch_module, arrays)


def to_nnx(module: torch.nn.Module, *, rngs: nnx.Rngs | None = None) -> NnxModule:
    """A ``flax.nnx.Module`` running the torch ``module``'s forward on JAX.

    Its ``params`` (an ``nnx.Dict`` keyed by the torch parameter names) hold
    ``nnx.Param`` variables and its ``buffers`` ``nnx.BatchStat`` variables; both
    start as copies of the torch module's values. Buffers the forward updates in
    place (BatchNorm running statistics) are written back into the ``BatchStat``
    variables, which ``nnx.jit`` / ``nnx.grad`` carry out of the transform.

    Mode: ``.train()`` / ``.eval()`` (nnx's, through the ``deterministic``
    attribute) select torch's train or eval forward. Random ops (dropout) in
    train mode draw their key from ``rngs`` (``rngs.dropout()``) when given, else
    from torch2jax's generator, which only works outside JAX transforms.
    ``.to_torch()`` copies the trained values back into the torch module.

    >>> model = t2j.modules.to_nnx(torch.nn.Linear(4, 2))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> grads = nnx.grad(lambda m: (m(x) ** 2).sum())(model)
    >>> opt.update(model, grads)
    """
    _check_torch_module("to_nnx", module)
    return NnxModule(module, rngs)


# ---------------------------------------------------------------------------
# torch -> equinox
# ---------------------------------------------------------------------------


class EquinoxModule(eqx.Module):
    """A torch module as an equinox module (see `to_equinox`)."""

    params: dict
    buffers: eqx.nn.StateIndex | None
    inference: bool
    functional: Functional = eqx.field(static=True)

    def __call__(self, *args, state: eqx.nn.State | None = None, key=None, **kwargs):
        if self.buffers is None:
            with _training(self.functional.module, not self.inference):
                return self.functional({"params": self.params, "buffers": {}}, *args, rng=key, **kwargs)
        if state is None:
            raise TypeError(
                f"t2j.modules.to_equinox: {type(self.functional.module).__name__} has buffers, which live in an "
                "eqx.nn.State: build the model with `model, state = eqx.nn.make_with_state(t2j.modules.to_equinox)"
                "(module)` and call it as `out, state = model(x, state=state)`"
            )
        buffers = state.get(self.buffers)
        with _training(self.functional.module, not self.inference):
            out, new = self.functional.apply({"params": self.params, "buffers": buffers}, *args, rng=key, **kwargs)
        return out, state.set(self.buffers, new["buffers"])

    def to_torch(self, state: eqx.nn.State | None = None) -> torch.nn.Module:
        """The torch module, its parameters (and buffers, from ``state``) overwritten in
        place with this module's values.

        >>> trained_torch_model = eqx_model.to_torch(state)
        """
        arrays = dict(self.params)
        if state is not None and self.buffers is not None:
            arrays.update(state.get(self.buffers))
        return _write_into_torch(self.functional.module, arrays)


def to_equinox(module: torch.nn.Module) -> EquinoxModule:
    """An ``equinox.Module`` running the torch ``module``'s forward on JAX.

    ``model.params`` is a dict (torch parameter name -> jax.Array), the module's
    only array leaves, so ``eqx.filter_grad`` / ``eqx.filter_jit`` and optax see
    exactly the parameters. Buffers follow equinox's stateful-layer convention
    (``eqx.nn.StateIndex``): a module with buffers is built with
    ``model, state = eqx.nn.make_with_state(t2j.modules.to_equinox)(module)``
    and called as ``out, state = model(x, state=state)``, which returns the
    updated buffers (BatchNorm running statistics). ``eqx.nn.inference_mode``
    selects torch's eval forward; random ops take ``key=``.

    >>> model = t2j.modules.to_equinox(torch.nn.Linear(4, 2))
    >>> grads = eqx.filter_grad(lambda m, x: (m(x) ** 2).sum())(model, x)
    """
    _check_torch_module("to_equinox", module)
    fn, state = functionalize(module)
    buffers = eqx.nn.StateIndex(state["buffers"]) if state["buffers"] else None
    return EquinoxModule(state["params"], buffers, not module.training, fn)


# ---------------------------------------------------------------------------
# JAX -> torch
# ---------------------------------------------------------------------------


def _key_name(k) -> str:
    # torch names cannot contain "." (a `to_nnx` module's keys do: "0.weight")
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr)).replace(".", "_")
    return str(k).replace(".", "_")


def _is_key(a) -> bool:
    return jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


class _Holder(torch.nn.Module):
    """A node of the parameter tree, so that names read ``layers.0.kernel``."""


class _Leaves:
    """The array leaves of a pytree, as torch tensors registered on a module
    under their tree paths, and back."""

    def __init__(self, owner: torch.nn.Module, tree, kind: str, drop_last: bool):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.kind = kind
        self.names, self.key_impls = [], []
        for path, a in flat:
            parts = [_key_name(k) for k in (path[:-1] if drop_last else path)]
            impl = jax.random.key_impl(a) if _is_key(a) else None
            value = jax.random.key_data(a) if impl is not None else a
            t = new_tensor(value)
            _register(owner, parts, torch.nn.Parameter(t) if kind == "param" else t, kind)
            self.names.append(".".join(parts))
            self.key_impls.append(impl)

    def tensors(self, owner: torch.nn.Module) -> list:
        # by attribute, not get_parameter: torch.func.functional_call (functionalize) swaps plain tensors in
        return [functools.reduce(getattr, n.split("."), owner) for n in self.names]

    def tree(self, arrays):
        arrays = [jax.random.wrap_key_data(a, impl=impl) if impl is not None else a
                  for a, impl in zip(arrays, self.key_impls)]
        return jax.tree_util.tree_unflatten(self.treedef, arrays)

    def flat(self, tree) -> list:
        leaves = self.treedef.flatten_up_to(tree)
        return [jax.random.key_data(a) if impl is not None else a for a, impl in zip(leaves, self.key_impls)]


def _register(owner: torch.nn.Module, parts: list, tensor, kind: str) -> None:
    node = owner
    for p in parts[:-1]:
        if p not in node._modules:
            node.add_module(p, _Holder())
        node = node._modules[p]
    if kind == "param":
        node.register_parameter(parts[-1], tensor)
    else:
        node.register_buffer(parts[-1], tensor)


@contextlib.contextmanager
def _jax_errors(fn_name: str, module, args):
    # A shape or dtype mismatch inside the JAX module surfaces as a JAX error deep in
    # its code: say which wrapped module and which inputs it came from.
    try:
        yield
    except (TypeError, ValueError) as e:
        shapes = ", ".join(f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                           for t in jax.tree_util.tree_leaves(args))
        raise type(e)(f"t2j.modules.{fn_name}: calling the wrapped {type(module).__name__} on inputs ({shapes}) "
                      f"failed: {e}") from e


def _write_buffers(buffers: list, values: list) -> None:
    """Write the JAX module's new state into its buffers; None: unchanged (an eval forward's
    statistics), not written, so that torch.func transforms, which refuse writes to the tensors
    they capture, run it."""
    with torch.no_grad():
        for b, v in zip(buffers, values):
            if v is not None:
                b.copy_(v)


def _changed(leaves: _Leaves, before: list, after) -> list:
    """``after``'s flat arrays, None where the leaf is still the array of ``before`` (the leaves
    given to the call, listed before it: nnx updates its state objects in place); a trace hands
    back the very value it was given for state the call did not update."""
    same = [a is b for a, b in zip(leaves.treedef.flatten_up_to(after), before)]
    return [None if s else a for a, s in zip(leaves.flat(after), same)]


class FromNnx(torch.nn.Module):
    """A flax nnx module as a torch module (see `from_nnx`)."""

    def __init__(self, module: nnx.Module):
        super().__init__()
        self._t2j_module = module
        self._t2j_graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        self.jax_params = _Holder()
        self.jax_state = _Holder()
        self._t2j_params = _Leaves(self.jax_params, params, "param", drop_last=True)
        self._t2j_rest = _Leaves(self.jax_state, rest, "buffer", drop_last=True)

    def forward(self, *args, **kwargs):
        graphdef, leaves, rest_leaves = self._t2j_graphdef, self._t2j_params, self._t2j_rest
        training = self.training

        def pure(param_arrays, rest_arrays, args, kwargs):
            rest = rest_leaves.tree(rest_arrays)
            before = rest_leaves.treedef.flatten_up_to(rest)
            module = nnx.merge(graphdef, leaves.tree(param_arrays), rest)
            module.set_attributes(deterministic=not training, use_running_average=not training,
                                  raise_if_not_found=False)
            out = module(*args, **kwargs)
            _, _, new_rest = nnx.split(module, nnx.Param, ...)
            return out, _changed(rest_leaves, before, new_rest)

        buffers = rest_leaves.tensors(self.jax_state)
        with _jax_errors("from_nnx", self._t2j_module, args):
            out, new_rest = call_jax(pure, leaves.tensors(self.jax_params), buffers, args, kwargs)
        _write_buffers(buffers, new_rest)
        return out

    def to_jax(self) -> nnx.Module:
        """The nnx module given to `from_nnx`, updated in place with this module's current
        parameters and state (what ``torch.optim`` trained), and returned.

        >>> trained = torch_side.to_jax()          # the same nnx.Module object
        """
        arrays = [t._value() for t in self._t2j_params.tensors(self.jax_params)]
        rest = [t._value() for t in self._t2j_rest.tensors(self.jax_state)]
        nnx.update(self._t2j_module, self._t2j_params.tree(arrays), self._t2j_rest.tree(rest))
        return self._t2j_module


def from_nnx(module: nnx.Module) -> FromNnx:
    """A ``torch.nn.Module`` running the flax nnx ``module``.

    Its ``nn.Parameter`` s (on the jax device, under ``jax_params``, named by the
    nnx paths: ``jax_params.linear.kernel``) hold the module's ``nnx.Param``
    arrays; every other nnx variable (BatchNorm statistics, RNG streams) is a
    buffer under ``jax_state``. The forward merges them into the nnx module and
    calls it through `t2j.call_jax`: torch autograd gets JAX's VJP, so
    ``loss.backward()`` fills the parameters' ``.grad``, ``torch.optim`` updates
    them and `t2j.jit` compiles the step. State the nnx forward updates (batch
    statistics, RNG counters) is written back into the buffers. The torch
    module's ``train()`` / ``eval()`` sets nnx's ``deterministic`` and
    ``use_running_average``.

    JAX arrays are immutable, so training changes the torch-side tensors only:
    ``.to_jax()`` writes the current values into the nnx module (``nnx.update``,
    in place) and returns it.

    >>> layer = t2j.modules.from_nnx(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    >>> layer(torch.randn(3, 4, device="jax")).sum().backward()
    >>> layer.jax_params.kernel.grad.shape
    torch.Size([4, 2])
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(f"t2j.modules.from_nnx: expected a flax.nnx.Module, got {type(module).__name__}")
    return FromNnx(module)


class FromEquinox(torch.nn.Module):
    """An equinox module as a torch module (see `from_equinox`)."""

    def __init__(self, module: eqx.Module, vmap: bool = False, state: eqx.nn.State | None = None,
                 axis_name: str = "batch"):
        super().__init__()
        self.vmap, self.axis_name = vmap, axis_name
        params, self._t2j_static = eqx.partition(module, eqx.is_inexact_array)
        self.jax_params = _Holder()
        self._t2j_params = _Leaves(self.jax_params, params, "param", drop_last=False)
        self._t2j_state = None
        if state is not None:
            self.jax_state = _Holder()
            self._t2j_state = _Leaves(self.jax_state, state, "buffer", drop_last=False)

    def forward(self, *args, **kwargs):
        leaves, static, training = self._t2j_params, self._t2j_static, self.training
        state_leaves, vmap, axis_name = self._t2j_state, self.vmap, self.axis_name

        def pure(param_arrays, state_arrays, args, kwargs):
            module = eqx.nn.inference_mode(eqx.combine(leaves.tree(param_arrays), static), value=not training)
            if state_leaves is None:
                return jax.vmap(module, axis_name=axis_name)(*args, **kwargs) if vmap else module(*args, **kwargs)
            state = state_leaves.tree(state_arrays)
            before = state_leaves.treedef.flatten_up_to(state)  # (equinox refuses a used state)

            def call(*a, **k):
                return module(*a, state=state, **k)

            out, new_state = (jax.vmap(call, axis_name=axis_name, out_axes=(0, None))(*args, **kwargs) if vmap
                              else call(*args, **kwargs))
            return out, _changed(state_leaves, before, new_state)

        buffers = state_leaves.tensors(self.jax_state) if state_leaves is not None else []
        with _jax_errors("from_equinox", self._t2j_static, args):
            out = call_jax(pure, leaves.tensors(self.jax_params), buffers, args, kwargs)
        if state_leaves is None:
            return out
        _write_buffers(buffers, out[1])
        return out[0]

    def to_jax(self):
        """A new equinox module (they are immutable) with this module's current parameters;
        ``(module, state)`` when it was built with a ``state``.

        >>> trained = torch_side.to_jax()
        """
        arrays = [t._value() for t in self._t2j_params.tensors(self.jax_params)]
        module = eqx.combine(self._t2j_params.tree(arrays), self._t2j_static)
        if self._t2j_state is None:
            return module
        return module, self._t2j_state.tree([t._value() for t in self._t2j_state.tensors(self.jax_state)])


def from_equinox(module: eqx.Module, state: eqx.nn.State | None = None, *, vmap: bool = False,
                 axis_name: str = "batch") -> FromEquinox:
    """A ``torch.nn.Module`` running the equinox ``module``.

    Every floating-point array leaf of the module becomes an ``nn.Parameter`` on
    the jax device under ``jax_params``, named by its path
    (``jax_params.layers.0.weight``); other leaves stay constant. The forward
    calls the module through `t2j.call_jax`, so gradients, ``torch.optim`` and
    `t2j.jit` work as for a torch layer; ``eval()`` turns on
    ``eqx.nn.inference_mode``. Equinox layers are usually written for one
    example: ``vmap=True`` maps the module over dim 0 of every tensor argument
    (under the vmap axis ``axis_name``, which ``eqx.nn.BatchNorm`` reduces over).

    A stateful module (``eqx.nn.make_with_state``) comes with its ``state``: its
    arrays become buffers under ``jax_state``, the forward calls
    ``module(x, state=state)`` and writes the returned state back into them.

    ``.to_jax()`` returns a new equinox module holding the current (trained)
    values, and the current state as well when there is one.

    >>> mlp = t2j.modules.from_equinox(eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0)), vmap=True)
    >>> mlp(torch.randn(16, 4, device="jax")).sum().backward()
    >>> bn = t2j.modules.from_equinox(*eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch"), vmap=True)
    """
    if not isinstance(module, eqx.Module):
        raise TypeError(f"t2j.modules.from_equinox: expected an equinox.Module, got {type(module).__name__}")
    if state is not None and not isinstance(state, eqx.nn.State):
        raise TypeError(f"t2j.modules.from_equinox: state must be an eqx.nn.State (from eqx.nn.make_with_state), "
                        f"got {type(state).__name__}")
    return FromEquinox(module, vmap, state, axis_name)


__all__ = ["EquinoxModule", "FromEquinox", "FromNnx", "NnxModule", "from_equinox", "from_nnx", "to_equinox", "to_nnx"]
