"""Running PyTorch's OpInfo samples on the jax device and comparing with torch CPU.

Used by tests/test_opinfo.py and by tools/op_coverage.py (which writes
docs/op_coverage.md). A sample passes when our result has torch's dtype and
shape and its values are within the dtype's tolerance of torch CPU's.
"""

from __future__ import annotations

import os

import jax
import torch
from torch.testing._internal.common_methods_invocations import op_db

import torch2jax  # noqa: F401
from torch2jax.tensor import Tensor, new_tensor

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "complex64": torch.complex64,
}
MODES = ("eager", "jit", "grad")

# Ops whose values are random: only shape and dtype are compared.
RANDOM_OPS = {
    "bernoulli", "normal", "normal_number_mean", "uniform", "randn", "rand", "randint", "randn_like", "rand_like",
    "randint_like", "multinomial", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "empty",
    "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted", "exponential", "geometric",
    "cauchy", "log_normal", "torch.empty", "poisson", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "normal_in_place", "bernoulli_", "uniform_",
}

TOLERANCE = {
    torch.float32: (1.3e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
    torch.complex64: (1.3e-5, 1e-5),
}

SAMPLES = int(os.environ.get("T2J_OPINFO_SAMPLES", "4"))


def cpu_ops():
    """(name, variant, OpInfo) for every op that supports CPU, de-duplicated by full name."""
    seen = {}
    for op in op_db:
        key = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        seen.setdefault(key, op)
    return seen


def _to_jax(x):
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return x.detach().to("jax").requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_jax(v) for v in x)
    if isinstance(x, dict):
        # factory samples ask for device="cpu": run them on the jax device instead
        return {k: ("jax" if k == "device" and str(v) == "cpu" else _to_jax(v)) for k, v in x.items()}
    return x


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu() if isinstance(x, Tensor) else x.detach()
    if isinstance(x, (list, tuple)):
        return [_to_cpu(v) for v in x]
    return x


def compare(actual, expected, dtype, values=True, where=""):
    """Assert our result matches torch CPU's: type, dtype, shape and values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual)}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != torch's {expected.dtype}"
        assert tuple(actual.shape) == tuple(expected.shape), f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        if values:
            atol, rtol = TOLERANCE.get(expected.dtype, TOLERANCE.get(dtype, (1e-5, 1.3e-6)))
            torch.testing.assert_close(
                actual, expected, atol=atol, rtol=rtol, equal_nan=True, check_device=False, msg=lambda m: f"{where}: {m}"
            )
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: structure differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            compare(a, e, dtype, values, f"{where}[{i}]")
    elif isinstance(expected, float) and values:
        assert abs(actual - expected) <= 1e-5 + 1e-5 * abs(expected) or (actual != actual and expected != expected)
    elif values:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def samples(op, dtype, requires_grad=False):
    out = []
    try:
        for s in op.sample_inputs("cpu", dtype, requires_grad=requires_grad):
            out.append(s)
            if len(out) >= SAMPLES:
                break
    except Exception as e:  # noqa: BLE001 - OpInfo's generator itself may not support the dtype
        if not out:
            raise RuntimeError(f"OpInfo sample generation failed: {e}") from e
    return out


def run_eager(op, sample):
    return op(_to_jax(sample.input), *_to_jax(sample.args), **_to_jax(sample.kwargs))


def run_jit(op, sample):
    """Run the op inside jax.jit: tensors in the sample become traced arguments."""
    inputs = (sample.input, sample.args, sample.kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(inputs, is_leaf=lambda x: isinstance(x, torch.Tensor))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    arrays = [_to_jax(leaves[i]).jax() for i in positions]
    out_tree = {}

    def fn(*arrays):
        filled = list(leaves)
        for i, a in zip(positions, arrays):
            filled[i] = new_tensor(a)
        inp, args, kwargs = jax.tree_util.tree_unflatten(treedef, filled)
        out = op(inp, *args, **kwargs)
        out_leaves, out_tree["def"] = jax.tree_util.tree_flatten(out, is_leaf=lambda x: isinstance(x, torch.Tensor))
        return [o.jax() if isinstance(o, Tensor) else o for o in out_leaves]

    with jax.enable_x64(True):
        outs = jax.jit(fn)(*arrays)
    outs = [new_tensor(o) if isinstance(o, jax.Array) else o for o in outs]
    return jax.tree_util.tree_unflatten(out_tree["def"], outs)


def grads(op, sample, device):
    """Gradients of sum(out * weights) with respect to every floating input tensor."""
    inputs = (sample.input, sample.args, sample.kwargs)
    if device == "jax":
        inputs = _to_jax(inputs)
    leaves = [x for x in jax.tree_util.tree_leaves(inputs, is_leaf=lambda x: isinstance(x, torch.Tensor))
              if isinstance(x, torch.Tensor) and x.requires_grad]
    out = op(inputs[0], *inputs[1], **inputs[2])
    outs = [o for o in jax.tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, torch.Tensor))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs or not leaves:
        return None
    gen = torch.Generator().manual_seed(0)
    total = 0
    for o in outs:
        w = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
        if device == "jax":
            w = w.to("jax")
        total = total + (o * w).sum().real if o.is_complex() else total + (o * w).sum()
    return torch.autograd.grad(total, leaves, allow_unused=True)
