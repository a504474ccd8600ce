"""`t2j.compile(module)`: a module whose forward runs as a compiled JAX program.

Without gradients (``torch.no_grad()``, eval loops, generation) the forward is a
`t2j.jit` function: buffers it updates and the RNG key are carried in and out.
With gradients it is one `torch.autograd.Function`: the forward is a jitted call
of the functionalized module and its backward a jitted JAX VJP (which recomputes
the forward, trading compute for memory), so ``loss.backward()`` on its output
fills ``.grad`` of the module's parameters and of the inputs.

Example::

    cm = t2j.compile(model)
    logits = cm(x)                   # compiled once per input shapes / static arguments
    loss_fn(logits, y).backward()
"""

from __future__ import annotations

import jax
import torch
import torch.utils._pytree as torch_pytree

from . import debug as _debug
from . import gradcut as _gradcut
from .env import default_rng as _rng
from .interop import Functional, differentiable_vjp, torch_pullback, zero_cotangent
from .jit import JitFunction, _static_key
from .tensor import Tensor, jax_array, new_tensor


def _array(t):
    return t._value() if isinstance(t, Tensor) else jax_array(t)


class _Forward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, program, n_params, *tensors):
        ctx.tensors = tensors
        ctx.inputs = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
        arrays = [_array(t) for t in tensors]
        # the backward recomputes the forward from the buffers it read, not the ones it wrote
        buffers = program.buffers()
        with jax.enable_x64(True):
            outs, new_params, new_buffers, ctx.key_out = program.forward(arrays[:n_params], arrays[n_params:],
                                                                         buffers)
        program.write_state(new_params, new_buffers)
        ctx.program, ctx.n_params, ctx.arrays, ctx.buffers, ctx.key = program, n_params, arrays, buffers, \
            program.last_key
        ctx.avals = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
        return tuple(new_tensor(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n_params

        def pull(arrays, cotangents):
            return ctx.program.pull(arrays[:n], arrays[n:], ctx.buffers, ctx.key, cotangents)

        if _gradcut.creates_graph((*ctx.inputs, *grads)):
            return (None, None, *differentiable_vjp(pull, ctx.tensors, grads, ctx.avals))
        cotangents = [_array(g) if g is not None else None for g in grads]
        with jax.enable_x64(True):
            g_params, g_inputs = ctx.program.backward(ctx.arrays[:n], ctx.arrays[n:], ctx.buffers, cotangents,
                                                      ctx.key)
        return (None, None, *[new_tensor(g) if g is not None else None for g in [*g_params, *g_inputs]])


class _Program:
    """Jitted forward and VJP of the functionalized module for one argument structure."""

    def __init__(self, module, spec, leaves, tensor_positions, floating, param_names, buffer_names):
        fn = Functional(module, x64=True)
        self.module = module
        # the program is traced lazily, outside the caller's autocast region: keep its state
        amp_enabled, amp_dtype = torch.is_autocast_enabled("jax"), torch.get_autocast_dtype("jax")
        self.param_names, self.buffer_names = param_names, buffer_names
        self.written_params = []
        self.last_key = None
        self.out_spec = None
        n_tensors = len(tensor_positions)

        def call(params, inputs, buffers, key):
            filled = list(leaves)
            for i, a in zip(tensor_positions, inputs):
                filled[i] = a
            args, kwargs = torch_pytree.tree_unflatten(filled, spec)
            state = {"params": dict(zip(param_names, params)), "buffers": dict(zip(buffer_names, buffers))}
            with _rng.traced_key(key) as r, torch.autocast("jax", dtype=amp_dtype, enabled=amp_enabled):
                out, new_state = fn.apply(state, *args, **kwargs)
            flat, self.out_spec = torch_pytree.tree_flatten(out)
            self.out_leaves = [None if isinstance(o, (jax.Array, jax.core.Tracer)) else o for o in flat]
            arrays = [o for o in flat if isinstance(o, (jax.Array, jax.core.Tracer))]
            # parameters the forward writes (weight clipping) are written back, the others not passed
            self.written_params = [n for n, p in zip(param_names, params) if new_state["params"][n] is not p]
            return (arrays, [new_state["params"][n] for n in self.written_params],
                    [new_state["buffers"][n] for n in buffer_names], r.key)

        def forward(params, inputs, buffers, key):
            return call(params, inputs, buffers, key)

        def pull(params, inputs, buffers, key, cotangents):
            # only floating inputs are differentiated: integer ids get no gradient
            def primal(p, x):
                merged = [a if not f else b for a, b, f in zip(inputs, _fill(x, floating), floating)]
                return call(p, merged, buffers, key)[0]

            diff_inputs = [x for x, f in zip(inputs, floating) if f]
            out, vjp = jax.vjp(primal, params, diff_inputs)
            cotangents = [zero_cotangent(o) if c is None else c for o, c in zip(out, cotangents)]
            g_params, g_inputs = vjp(cotangents)
            return [*g_params, *_fill(g_inputs, floating)]

        def backward(params, inputs, buffers, key, cotangents):
            grads = torch_pullback(lambda _, c: pull(params, inputs, buffers, key, c), None, cotangents)
            return grads[:len(params)], grads[len(params):]

        self.pull = pull
        self._forward = jax.jit(forward)
        self._backward = jax.jit(backward)
        self.n_tensors = n_tensors

    def buffers(self):
        bufs = dict(self.module.named_buffers())
        return [_array(bufs[n]) for n in self.buffer_names]

    def forward(self, params, inputs, buffers):
        self.last_key = _rng.key
        outs, new_params, new_buffers, key = self._forward(params, inputs, buffers, self.last_key)
        _rng.key = key
        return outs, new_params, new_buffers, key

    def backward(self, params, inputs, buffers, cotangents, key):
        return self._backward(params, inputs, buffers, key, cotangents)

    def write_state(self, params, buffers):
        """Write the forward's new parameter values (`written_params`) and buffers into the module."""
        tensors = dict(self.module.named_parameters())
        tensors.update(self.module.named_buffers())
        for name, a in zip([*self.written_params, *self.buffer_names], [*params, *buffers]):
            st = tensors[name]._t2j_storage
            st.array = a
            st.version += 1


def _fill(values, mask):
    """``values`` spread over the True positions of ``mask``; None elsewhere."""
    it = iter(values)
    return [next(it) if m else None for m in mask]


class CompiledModule(torch.nn.Module):
    """A module whose forward is compiled (see `compile`)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self._no_grad = JitFunction(module.__call__)
        self._programs: dict = {}

    def forward(self, *args, **kwargs):
        params = dict(self.module.named_parameters())
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params.values())
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in torch_pytree.tree_leaves((args, kwargs)))
        )
        if not needs_grad:
            return self._no_grad(*args, **kwargs)
        leaves, spec = torch_pytree.tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        avals = tuple((tuple(leaves[i].shape), leaves[i].dtype) for i in positions)
        key = (spec, _static_key(leaves), avals, self.module.training, tuple(params),
               torch.is_autocast_enabled("jax"), torch.get_autocast_dtype("jax"))
        program = self._programs.get(key)
        if program is not None:
            _debug.count("cache_hits")
        else:
            _debug.count("traces")
            _debug.count("compiles")
            statics = [None if isinstance(x, torch.Tensor) else x for x in leaves]
            floating = [leaves[i].is_floating_point() or leaves[i].is_complex() for i in positions]
            program = self._programs[key] = _Program(
                self.module, spec, statics, positions, floating, list(params),
                [n for n, _ in self.module.named_buffers()],
            )
        outs = iter(_Forward.apply(program, len(params), *params.values(), *[leaves[i] for i in positions]))
        flat = [next(outs) if o is None else o for o in program.out_leaves]
        return torch_pytree.tree_unflatten(flat, program.out_spec)


def compile(module: torch.nn.Module) -> CompiledModule:  # noqa: A001 - mirrors torch.compile
    """Wrap ``module`` so that its forward runs as a compiled program, cached per
    input shapes, dtypes and non-tensor arguments; gradients flow back to the
    module's parameters and the inputs (see this module's docstring).

    >>> cm = t2j.compile(torch.nn.Linear(4, 2).to("jax"))
    >>> cm(torch.randn(3, 4, device="jax")).sum().backward()
    """
    return CompiledModule(module)
