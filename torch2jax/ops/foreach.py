"""Decompositions: torch's ``_foreach_*`` ops, the per-tensor op over each list element.

``torch.optim`` with ``foreach=True``, ``clip_grad_norm_`` and friends call list ops
such as ``_foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)``. Each one
runs here as its per-tensor op (``addcmul_``) on every element, so in-place writes
go through the usual view and aliasing machinery. Under ``t2j.jit`` XLA fuses the
elementwise work of the whole step whatever its grouping, so the loop costs nothing
there; eagerly it is one op call per element.

    >>> torch._foreach_add_([a, b], [c, d], alpha=2)   # a += 2 * c; b += 2 * d
"""

from __future__ import annotations

import torch

from .registry import DECOMPOSITIONS

aten = torch.ops.aten

# foreach names whose per-tensor op is called differently
_PER_TENSOR = {"norm": "linalg_vector_norm"}
# ``addcmul`` / ``addcdiv`` take a list (or a 1-D tensor) of ``scalars`` for their ``value``
_POINTWISE = {"addcmul": aten.mul, "addcdiv": aten.div}
# ``maximum`` / ``minimum`` against a Python number
_SCALAR_CLAMP = {"maximum": "clamp_min", "minimum": "clamp_max"}


def _kwarg_only_names(packet) -> frozenset:
    return frozenset(
        a.name for name in packet.overloads() for a in getattr(packet, name)._schema.arguments if a.kwarg_only
    )


def _is_list(arg) -> bool:
    return isinstance(arg.type, torch.ListType)


def _per_element(foreach_op):
    """The decomposition of one ``_foreach_*`` overload: its per-tensor op, element by element."""
    schema = foreach_op._schema
    base = schema.name.split("::")[1][len("_foreach_"):]
    inplace = base.endswith("_")
    name = base.rstrip("_")
    functional = getattr(aten, _PER_TENSOR.get(name, name), None)
    if functional is None:
        return None
    # an in-place op without a per-tensor in-place variant (maximum_) writes with copy_
    in_place = getattr(aten, name + "_", None) if inplace else None
    by_keyword = _kwarg_only_names(functional)
    arguments = schema.arguments
    scalar_clamp = _SCALAR_CLAMP.get(name)

    def decomposed(*args, **kwargs):
        bound = list(args) + [kwargs.get(a.name, a.default_value) for a in arguments[len(args):]]
        lists = [v for a, v in zip(arguments, bound) if _is_list(a)]
        n = len(lists[0])
        if any(len(v) != n for v in lists):
            raise RuntimeError(
                f"{foreach_op}: the tensor and scalar lists must all have the same length, got "
                f"{[len(v) for v in lists]}"
            )

        def call(pick, inplace):
            positional, keywords = [], {}
            for a, v in zip(arguments, bound):
                value = pick(a, v)
                if a.name == "scalars" and name in _POINTWISE:
                    keywords["value"] = value
                elif a.kwarg_only or a.name in by_keyword:
                    keywords[a.name] = value
                else:
                    positional.append(value)
            return _apply(name, functional, in_place, scalar_clamp, positional, keywords, inplace)

        if inplace and n > 1 and _scalars_only(arguments, bound):
            # one op over the stacked 0-d targets, then each takes its element (a result of another
            # dtype goes the per-element way, whose in-place op raises torch's casting error)
            out = call(lambda a, v: torch.stack(list(v)) if _is_list(a) else v, inplace=False)
            if out.dtype == lists[0][0].dtype:
                for t, value in zip(lists[0], out.unbind()):
                    t.copy_(value)
                return None
        bound = [_packed_scalars(v, n) if a.name == "scalars" and isinstance(v, torch.Tensor) else v
                 for a, v in zip(arguments, bound)]
        results = [
            call(lambda a, v: v[i] if _is_list(a) or (a.name == "scalars" and isinstance(v, (torch.Tensor, list)))
                 else v, inplace)
            for i in range(n)
        ]
        return None if inplace else results

    return decomposed


def _packed_scalars(scalars, n):
    """The values of a packed 1-D tensor of ``scalars`` (addcmul / addcdiv's ``.Tensor``
    overloads), checked as torch checks them. One on the CPU gives its Python numbers: torch
    reads them out (convert_tensor_to_scalar_list) and runs each element's op with its number,
    so the op keeps its precision and its checks on the value; one on the jax device (a
    compiled optimizer's stacked step sizes) stays a tensor, whose elements ``_apply`` takes."""
    if scalars.dim() != 1:
        raise RuntimeError(f"Expected packed scalar Tensor to be of dimension 1. Got {scalars.dim()} instead.")
    if scalars.numel() != n:
        raise RuntimeError(f"Expected length of scalars to match input of length {n} but got {scalars.numel()} "
                           "instead.")
    return scalars.tolist() if scalars.device.type == "cpu" else scalars


def _add_scaled_pointwise(name, x, t1, t2, value, inplace):
    """``x + value * t1 op t2`` for a tensor ``value``, as the per-tensor op's kernel computes
    it with a number: in float32 for float16 / bfloat16 (torch's opmath, ``value`` not rounded
    to the narrow dtype), ``value * t1`` first and then the op itself with value 1, so that the
    product and the sum round (or fuse) as in ``addcmul`` / ``addcdiv``."""
    if value.is_complex() and not x.is_complex():
        raise RuntimeError(f"_foreach_{name}: a complex value cannot be converted to {x.dtype} without overflow")
    if not (x.is_floating_point() or x.is_complex()) or not t1.dtype == t2.dtype == x.dtype:
        product = _POINTWISE[name](aten.mul(value, t1), t2)  # mixed dtypes: torch's promotion decides
        return aten.add_(x, product) if inplace else aten.add(x, product)
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    scaled = aten.mul(t1.to(compute), value.to(compute))
    out = getattr(aten, name)(x.to(compute), scaled, t2.to(compute)).to(x.dtype)
    return x.copy_(out) if inplace else out


def _scalars_only(arguments, bound) -> bool:
    """Whether an in-place foreach call works on 0-d jax tensors of one dtype only (torch.optim's
    step counters), each target a tensor of its own that no other list shows elsewhere: then
    one op over them stacked computes what the op on each in turn would (with one dtype, no
    promotion of a 0-d operand against a 1-d one differs)."""
    lists = [v for a, v in zip(arguments, bound) if _is_list(a)]
    tensors = [v for a, v in zip(arguments, bound) if not _is_list(a) and isinstance(v, torch.Tensor)]
    items = [t for v in lists for t in v] + tensors
    if not all(isinstance(t, torch.Tensor) and t.dim() == 0 and t.device.type == "jax" for t in items):
        return False
    if len({t.dtype for t in items}) != 1 or items[0].dtype == torch.bool:
        return False
    targets = lists[0]
    if any(t._t2j_view for t in targets):
        return False
    where = {id(t._t2j_storage): i for i, t in enumerate(targets)}
    if len(where) != len(targets):
        return False
    return all(where.get(id(t._t2j_storage), i) == i for v in lists[1:] for i, t in enumerate(v)) and not any(
        id(t._t2j_storage) in where for t in tensors)


def _apply(name, functional, in_place, scalar_clamp, positional, keywords, inplace):
    op = in_place if inplace else functional
    if isinstance(keywords.get("value"), torch.Tensor):
        # a tensor-valued ``value`` (an element of a jax tensor of scalars)
        x, t1, t2 = positional
        return _add_scaled_pointwise(name, x, t1, t2, keywords["value"], inplace)
    elif scalar_clamp is not None and not isinstance(positional[1], torch.Tensor):
        functional = getattr(aten, scalar_clamp)  # maximum(x, 2.0) is clamp_min(x, 2.0)
        op = getattr(aten, scalar_clamp + "_") if inplace else functional
    if op is not None:
        return op(*positional, **keywords)
    out = functional(*positional, **keywords)
    positional[0].copy_(out)
    return positional[0]


def _register_all() -> None:
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()}
    for name in sorted(n for n in names if n.startswith("_foreach_")):
        packet = getattr(aten, name, None)
        if packet is None:  # registered names without a Python binding
            continue
        for overload in packet.overloads():
            if overload.endswith("out"):  # out= list variants keep the host fallback
                continue
            op = getattr(packet, overload)
            fn = _per_element(op)
            if fn is not None and op not in DECOMPOSITIONS:
                DECOMPOSITIONS[op] = fn


_register_all()


# -- fused optimizer steps -------------------------------------------------------


def _fused_step_parts(grads, grad_scale, found_inf, maximize):
    """What torch's fused optimizer kernels share: ``write(t, new)``, which leaves every tensor
    as it was where ``found_inf`` is set (GradScaler saw an inf; a ``where``, so it also
    traces), and ``gradient(i)``, the ``i``-th gradient unscaled by ``grad_scale`` (written
    back, as the kernels do) and negated under ``maximize``."""
    skip = None if found_inf is None else found_inf.reshape(()).bool()

    def write(t, new):
        t.copy_(new if skip is None else torch.where(skip, t, new))

    def gradient(i):
        g = grads[i]
        if grad_scale is not None:
            g = g / grad_scale
            write(grads[i], g)
        return -g if maximize else g

    return write, gradient


def _fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                     weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled):
    """One Adam(W) step over the lists, as torch's fused kernel computes it (the step
    counters are already incremented). With ``found_inf`` set (GradScaler saw an inf)
    every tensor keeps its value; selected with ``where`` so it also traces."""
    write, gradient = _fused_step_parts(grads, grad_scale, found_inf, maximize)
    # the bias corrections of every parameter at once: one op over the stacked step counters
    # instead of a handful of scalar ops (a kernel each on an accelerator) per parameter; in
    # float64 as torch's kernel (1 - 0.999 in float32 is off by 1e-5)
    steps = torch.stack([s.reshape(()) for s in state_steps]).double() if params else None
    step_sizes = lr / (1 - torch.pow(beta1, steps)) if params else None
    bias_corrections2_sqrt = torch.sqrt(1 - torch.pow(beta2, steps)) if params else None
    for i, p in enumerate(params):
        g = gradient(i)
        param = p
        if weight_decay != 0:
            if decoupled:
                param = param * (1 - lr * weight_decay)
            else:
                g = g + param * weight_decay
        exp_avg = torch.lerp(exp_avgs[i], g, 1 - beta1)
        exp_avg_sq = exp_avg_sqs[i] * beta2 + (1 - beta2) * g * g
        second = exp_avg_sq
        if amsgrad:
            second = torch.maximum(max_exp_avg_sqs[i], exp_avg_sq)
            write(max_exp_avg_sqs[i], second)
        denom = torch.sqrt(second) / bias_corrections2_sqrt[i] + eps
        write(p, param - step_sizes[i] * exp_avg / denom)
        write(exp_avgs[i], exp_avg)
        write(exp_avg_sqs[i], exp_avg_sq)


def _fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **hyper):
    _fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                     grad_scale=hyper.pop("grad_scale", None), found_inf=hyper.pop("found_inf", None),
                     decoupled=False, **hyper)


def _fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **hyper):
    _fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                     grad_scale=hyper.pop("grad_scale", None), found_inf=hyper.pop("found_inf", None),
                     decoupled=True, **hyper)


def _fused_sgd_(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize,
                is_first_step, grad_scale=None, found_inf=None):
    """One SGD step over the lists, as torch's fused kernel computes it: the gradient
    unscaled (and written back) by ``grad_scale``, then weight decay, momentum (the
    first step's buffer is the gradient), Nesterov; nothing changes where ``found_inf``."""
    write, gradient = _fused_step_parts(grads, grad_scale, found_inf, maximize)
    for i, p in enumerate(params):
        g = gradient(i)
        if weight_decay != 0:
            g = g + p * weight_decay
        if momentum != 0:
            buf = g if is_first_step else momentum_buffer_list[i] * momentum + (1 - dampening) * g
            write(momentum_buffer_list[i], buf)
            g = g + buf * momentum if nesterov else buf
        write(p, p - lr * g)


def _fused_adagrad_(params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
                    grad_scale=None, found_inf=None):
    """One Adagrad step over the lists, as torch's fused kernel computes it (the step
    counters are already incremented): the gradient unscaled (and written back), weight
    decay, the squared gradient summed, then the step at ``lr / (1 + (step - 1) * lr_decay)``."""
    write, gradient = _fused_step_parts(grads, grad_scale, found_inf, maximize)
    steps = torch.stack([s.reshape(()) for s in state_steps]).double() if params else None
    clrs = lr / (1 + (steps - 1) * lr_decay) if params else None
    for i, p in enumerate(params):
        g = gradient(i)
        if weight_decay != 0:
            g = g + p * weight_decay
        state_sum = state_sums[i] + g * g
        write(state_sums[i], state_sum)
        write(p, p - clrs[i] * g / (torch.sqrt(state_sum) + eps))


for _op, _fn in ((aten._fused_adam_, _fused_adam_), (aten._fused_adamw_, _fused_adamw_), (aten._fused_sgd_, _fused_sgd_),
                 (aten._fused_adagrad_, _fused_adagrad_)):
    for _overload in _op.overloads():
        DECOMPOSITIONS[getattr(_op, _overload)] = _fn
