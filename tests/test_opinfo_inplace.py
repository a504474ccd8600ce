"""In-place variants (``x.add_(y)``) of every OpInfo op that has one, against torch CPU, on
four layouts of the written tensor:

- ``plain``: the sample's input;
- ``strided``: a transposed, sliced view of a larger base (the base must change as on CPU);
- ``expanded``: its first row expanded to the input's shape (one element in several places:
  torch refuses most such writes, "more than one element of the written-to tensor ...");
- ``partial``: a tensor argument that shares memory with the input, shifted by one element
  (torch refuses such writes for elementwise ops, "some elements of the input tensor ...").

Whatever the CPU kernel does is the specification: it raises (the same error type here, with
the same message for the overlap errors), or it writes, and then the values of the input (and
its base), the returned tensor's identity (``out is x``), dtype and shape must match. Where the
CPU result depends on the order its kernel visits elements (an argument it overwrites while
reading it, ``x.addmm_(x, m)``; a write through an expanded tensor by ``addmv_`` or
``index_put_(accumulate=True)``), only whether it raises is compared.

The ops in ``CI_OPS`` run in CI; the rest are marked slow.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from opinfo_util import RANDOM_OPS, _to_cpu, _to_jax, compare, cpu_ops, samples

DTYPES = (torch.float32, torch.int64, torch.complex64)
LAYOUTS = ("plain", "strided", "expanded", "partial")
CI_OPS = {
    "abs", "add", "addcmul", "addmm", "clamp", "conj_physical", "copysign", "div", "eq", "floor_divide", "lerp",
    "masked_fill", "mul", "nn.functional.relu", "renorm", "sigmoid", "sub", "tril", "where",
}
# CPU kernels whose result through an expanded tensor depends on their visiting order
ORDER_DEPENDENT = {"addmv", "baddbmm", "index_put", "masked_scatter", "addmm", "addmm.decomposed", "addbmm", "addr",
                   "index_add", "scatter_add", "index_reduce", "scatter_reduce"}
OVERLAP_MESSAGES = ("more than one element of the written-to tensor", "some elements of the input tensor")


def _cases():
    for key, op in sorted(cpu_ops().items()):
        if op.inplace_variant is None:
            continue
        for dtype in DTYPES:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            for layout in LAYOUTS:
                marks = [] if op.name in CI_OPS and dtype != torch.complex64 else [pytest.mark.slow]
                yield pytest.param(key, dtype, layout, id=f"{key}|{str(dtype)[6:]}|{layout}", marks=marks)


def _strided(x):
    """``x``'s values in a transposed, sliced view of a larger base: (view, base)."""
    shape = x.shape[::-1]
    base = torch.zeros((shape[0] + 2, *shape[1:]), dtype=x.dtype, device=x.device)
    view = base[1:-1].permute(*reversed(range(x.dim())))
    view.copy_(x)
    return view, base


def _layouts(x, args, layout):
    """(input, args, tensor to compare afterwards) for ``layout``, or None where it does not apply."""
    if layout == "plain":
        x = x.clone()
        return x, args, x
    if x.dim() < 2 and layout == "strided" or x.numel() < 2:
        return None
    if layout == "strided":
        view, base = _strided(x)
        return view, args, base
    if layout == "expanded":
        row = x[:1].clone()
        return row.expand_as(x), args, row
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dtype == x.dtype
               and a.shape == x.shape]
    if not tensors:
        return None
    flat = torch.cat([x.reshape(-1), x.reshape(-1)[:1]])
    x = flat[:-1].view(x.shape)
    args = list(args)
    args[tensors[0]] = flat[1:].view(x.shape)
    return x, args, flat


def _run(op, x, args, kwargs):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return op.inplace_variant(x, *args, **kwargs), None
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        return None, e


@pytest.mark.parametrize("name,dtype,layout", list(_cases()))
def test_inplace_variant_matches_torch(name, dtype, layout):
    op = cpu_ops()[name]
    ran = 0
    for i, sample in enumerate(samples(op, dtype)):
        if not isinstance(sample.input, torch.Tensor):
            continue
        made = _layouts(sample.input, sample.args, layout)
        if made is None:
            continue
        x, args, seen = made
        xj, argsj, seenj = _to_jax(x), _to_jax(args), None
        # the jax copies must share memory as the CPU ones do: rebuild them from one jax base
        if layout == "plain":
            seenj = xj
        elif layout == "strided":
            seenj = _to_jax(seen)
            xj = seenj[1:-1].permute(*reversed(range(x.dim())))
        elif layout == "expanded":
            seenj = _to_jax(seen)
            xj = seenj.expand(x.shape)
        else:
            seenj = _to_jax(seen)
            xj = seenj[:-1].view(x.shape)
            k = next(k for k, a in enumerate(args) if a is not sample.args[k])
            argsj = list(argsj)
            argsj[k] = seenj[1:].view(x.shape)
        kwargs, kwargsj = sample.kwargs, _to_jax(sample.kwargs)
        where = f"{name} {dtype} {layout} sample {i}"
        out, error = _run(op, x, args, kwargs)
        outj, errorj = _run(op, xj, argsj, kwargsj)
        ran += 1
        if error is not None:
            assert errorj is not None, f"{where}: torch CPU raised {type(error).__name__}: {error}; we wrote"
            assert isinstance(errorj, type(error)), f"{where}: {type(errorj).__name__}: {errorj} vs {error}"
            if any(m in str(error) for m in OVERLAP_MESSAGES):
                assert str(errorj) == str(error), where
            continue
        assert errorj is None, f"{where}: we raised {type(errorj).__name__}: {errorj}; torch CPU wrote"
        assert (outj is xj) == (out is x), f"{where}: the result is {'not ' if out is x else ''}the input"
        if layout == "partial" or layout == "expanded" and op.name in ORDER_DEPENDENT:
            continue
        random = op.name in RANDOM_OPS or name in RANDOM_OPS or name.replace(".", "_") in RANDOM_OPS
        compare(_to_cpu(seenj), seen.detach(), dtype, values=not random, where=where)
    if ran == 0:
        pytest.skip(f"no sample of {name} fits the {layout} layout")
