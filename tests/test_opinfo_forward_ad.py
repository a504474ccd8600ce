"""Forward-mode AD (``torch.autograd.forward_ad`` dual tensors) and double backward of OpInfo ops,
in float64, against torch CPU.

Forward mode runs torch's tangent formulas on jax tensors (the ops they call, ``_efficientzerotensor``
and the like, dispatch as any other); double backward runs the backward graph's own backward. Both
compare every output (the tangents; the second-order gradients of a weighted sum) with the CPU's.
The ops in ``CI_OPS`` (forward mode) and ``CI_GRADGRAD`` run in CI, the first three samples each; the
rest are marked slow.
"""

from __future__ import annotations

import jax
import pytest
import torch
import torch.autograd.forward_ad as fwAD

from opinfo_util import RANDOM_OPS, SIGN_FREE, PHASE_FREE, _args, _to_jax, compare, cpu_ops

SAMPLES = 3
CI_OPS = {
    "add", "mul", "pow", "exp", "log_softmax", "matmul", "var", "cumsum", "where", "gather", "nn.functional.conv2d",
    "nn.functional.layer_norm", "nn.functional.cross_entropy", "linalg.solve", "clamp",
    "nn.functional.scaled_dot_product_attention",
}
CI_GRADGRAD = {"mul", "pow", "exp", "log_softmax", "matmul", "where", "cumsum", "linalg.solve"}
# random values (dropout inside the op), or outputs defined up to sign / phase
SKIPPED = RANDOM_OPS | set(SIGN_FREE) | PHASE_FREE | {"nn.functional.multi_head_attention_forward"}


def _tensors(tree):
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, torch.Tensor))
            if isinstance(x, torch.Tensor)]


def _inputs(op, sample, device):
    if device == "cpu":
        return sample.input, sample.args, sample.kwargs
    return _to_jax(sample.input), _args(op, sample), _to_jax(sample.kwargs)


def _weights(tensors):
    """One fixed random weight (or tangent) per tensor, the same on both devices."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(t.shape, generator=gen, dtype=torch.complex128 if t.is_complex() else torch.float64)
            .to(t.device, t.dtype) for t in tensors]


def tangents(op, sample, device):
    """The tangents of every output, for one random tangent per differentiable input."""
    x, args, kwargs = _inputs(op, sample, device)
    leaves = [t for t in _tensors((x, args, kwargs)) if t.requires_grad]
    directions = dict(zip(map(id, leaves), _weights(leaves)))
    with fwAD.dual_level():
        def dual(t):
            return fwAD.make_dual(t.detach(), directions[id(t)]) if id(t) in directions else t

        x, args, kwargs = jax.tree_util.tree_map(dual, (x, args, kwargs),
                                                 is_leaf=lambda t: isinstance(t, torch.Tensor))
        return [fwAD.unpack_dual(o).tangent for o in _tensors(op(x, *args, **kwargs))]


def second_order(op, sample, device):
    """d/dinputs of <weights2, d/dinputs <weights, outputs>>: the gradients of the gradients."""
    x, args, kwargs = _inputs(op, sample, device)
    leaves = [t for t in _tensors((x, args, kwargs)) if t.requires_grad]
    outs = [o for o in _tensors(op(x, *args, **kwargs)) if o.requires_grad]
    if not leaves or not outs:
        return None
    total = sum(((o * w).sum().real if o.is_complex() else (o * w).sum()) for o, w in zip(outs, _weights(outs)))
    firsts = [g for g in torch.autograd.grad(total, leaves, create_graph=True, allow_unused=True)
              if g is not None and g.requires_grad]
    if not firsts:
        return None
    again = sum(((g * w).sum().real if g.is_complex() else (g * w).sum()) for g, w in zip(firsts, _weights(firsts)))
    return list(torch.autograd.grad(again, leaves, allow_unused=True))


def _cases(flag, ci):
    for key, op in sorted(cpu_ops().items()):
        if not getattr(op, flag) or op.name in SKIPPED or torch.float64 not in op.supported_dtypes("cpu"):
            continue
        yield pytest.param(key, id=key, marks=[] if key in ci else [pytest.mark.slow])


def _check(key, run):
    op = cpu_ops()[key]
    checked = 0
    for i, sample in enumerate(op.sample_inputs("cpu", torch.float64, requires_grad=True)):
        if i >= SAMPLES:
            break
        if sample.kwargs.get("dropout_p"):  # (random: attention's dropout)
            continue
        try:
            expected = run(op, sample, "cpu")
        except Exception:  # noqa: BLE001 - torch cannot differentiate this sample this way
            continue
        if expected is None:
            continue
        compare(run(op, sample, "jax"), expected, torch.float64, True, f"{key} sample {i}")
        checked += 1
    return checked


@pytest.mark.parametrize("key", list(_cases("supports_forward_ad", CI_OPS)))
def test_forward_mode_ad_matches_torch(key):
    _check(key, tangents)


@pytest.mark.parametrize("key", list(_cases("supports_gradgrad", CI_GRADGRAD)))
def test_double_backward_matches_torch(key):
    _check(key, second_order)


def test_ci_ops_exist_and_are_checked():
    """Every name in CI_OPS is an OpInfo op here (a renamed op would silently drop out of CI)."""
    ops = cpu_ops()
    assert CI_OPS | CI_GRADGRAD <= set(ops), sorted((CI_OPS | CI_GRADGRAD) - set(ops))
    assert _check("mul", tangents) > 0 and _check("mul", second_order) > 0
