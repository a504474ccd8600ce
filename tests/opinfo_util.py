"""Running PyTorch's OpInfo samples on the jax device and comparing with torch CPU.

Used by tests/test_opinfo.py and by tools/op_coverage.py (which writes
docs/op_coverage.md). A sample passes when our result has torch's dtype and
shape and its values are within the dtype's tolerance of torch CPU's.
"""

from __future__ import annotations

import os
import typing

import jax
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import SampleInput

import torch2jax
from torch2jax.complex32 import retag
from torch2jax.symbolic import is_traced_number, value_of
from torch2jax.tensor import Tensor, new_tensor

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex32": torch.complex32,  # beyond the dtypes: JAX has none (torch2jax/complex32.py)
    # eager mode only (tests/test_opinfo.py): the widest and the narrow integer types
    "float64": torch.float64,
    "complex128": torch.complex128,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
}
MODES = ("eager", "jit", "grad", "t2j_jit")

# Ops whose values are random: only shape and dtype are compared.
RANDOM_OPS = {
    "bernoulli", "normal", "normal_number_mean", "uniform", "randn", "rand", "randint", "randn_like", "rand_like",
    "randint_like", "multinomial", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "empty",
    "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted", "exponential", "geometric",
    "cauchy", "log_normal", "torch.empty", "poisson", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "normal_in_place", "bernoulli_", "uniform_",
}

# Ops that return a singular value decomposition (U, S, V or V^H): singular vectors are
# defined up to sign (phase), and past the rank (full_matrices=True) up to a basis of the
# null space. LAPACK builds (jax's and torch's) pick differently, and the low-rank ops
# follow a random projection our generator draws differently from torch CPU's; so these
# compare what is unique: the singular values, the product U diag(S) V^H, and U^H U and
# V^H V (orthonormal columns). The value says whether the op returns V^H (else V).
SIGN_FREE = {"svd_lowrank": False, "pca_lowrank": False, "svd": False, "linalg.svd": True}

# Ops whose eigenvectors are defined up to sign (phase) and whose LAPACK (jax's and
# torch's are different builds) may pick either: each vector is compared scaled so
# that its largest-magnitude entry is real and positive.
PHASE_FREE = {"linalg.eigh", "linalg.eig"}

# Ops whose positional arguments torch requires on the CPU whatever the input's device
# (as in torch's own tests on CUDA): they stay CPU tensors.
HOST_ARGS = {"tensor_split"}

# Ops that leave the order of equal elements unspecified (torch's unstable sort and
# selection; mode returns the index of any occurrence of its value): positions of `dim`
# and `keepdim` among the positional arguments (None: the op keeps the dimension).
TIE_OPS = {"sort": (0, None), "argsort": (0, None), "topk": (1, None), "kthvalue": (1, 2), "mode": (0, 1)}

TOLERANCE = {
    torch.float32: (1.3e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
    torch.complex64: (1.3e-5, 1e-5),
    torch.float64: (1e-7, 1e-7),  # torch.testing's defaults for the double types
    torch.complex128: (1e-7, 1e-7),
}

SAMPLES = int(os.environ.get("T2J_OPINFO_SAMPLES", "4"))


def cpu_ops():
    """(name, variant, OpInfo) for every op that supports CPU, de-duplicated by full name."""
    seen = {}
    for op in op_db:
        key = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        seen.setdefault(key, op)
    return seen


def _to_device(x):
    """``x`` on the jax device as if created there: a view into a larger storage
    (as_strided samples) stays a view of that whole storage moved over."""
    numel = x.untyped_storage().nbytes() // x.element_size() if x.layout == torch.strided else 0
    if x.layout != torch.strided or (x.storage_offset() == 0 and numel == x.numel()):
        return x.detach().to("jax").requires_grad_(x.requires_grad)
    storage = x.detach().as_strided((numel,), (1,), 0).to("jax").requires_grad_(x.requires_grad)
    return storage.as_strided(x.shape, x.stride(), x.storage_offset())


def _storage(x):
    """The tensor a traced argument is made from: a view made by `_to_device` passes its whole storage."""
    return x._base if x._base is not None else x


def _rebuild(x, traced):
    """``x`` inside the traced function, from ``traced`` (its `_storage`)."""
    return traced if x._base is None else traced.as_strided(x.shape, x.stride(), x.storage_offset())


def _to_jax(x):
    """The sample as if made for the jax device: tensors moved, and the factories'
    and ``to``'s device "cpu" (a string or torch.device) becoming "jax"."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return _to_device(x)
    if (isinstance(x, torch.device) and x.type == "cpu") or (isinstance(x, str) and x == "cpu"):
        return "jax"
    if isinstance(x, (list, tuple)):
        return type(x)(_to_jax(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_jax(v) for k, v in x.items()}
    return x


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu() if isinstance(x, Tensor) else x.detach()
    if isinstance(x, (list, tuple)):
        return [_to_cpu(v) for v in x]
    return x


def compare(actual, expected, dtype, values=True, where="", reference=None, guarded=True):
    """Assert our result matches torch CPU's: type, dtype, shape and values.

    ``reference`` (optional, the same op run in float64 on the CPU) relaxes the value
    check where torch's own rounding differs from ours: a floating result that misses
    torch's within the dtype's tolerance still passes when it is, element by element,
    as close to the float64 result as torch's is (twice torch's worst error, plus the
    tolerance), with NaN and infinities where torch has them, or when it is within the
    tolerance of the float64 result itself. ``guarded``: no allowance where torch's own
    error is beyond rounding (a result tied to the dtype, as finfo limits are, is no
    approximation of the float64 one); gradients, whose formulas can lose far more than
    rounding, are compared unguarded.
    """
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual)}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != torch's {expected.dtype}"
        assert tuple(actual.shape) == tuple(expected.shape), f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        if values:
            atol, rtol = TOLERANCE.get(expected.dtype, TOLERANCE.get(dtype, (1e-5, 1.3e-6)))
            try:
                torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True, check_device=False,
                                           msg=lambda m: f"{where}: {m}")
            except AssertionError:
                if not _as_accurate_as_torch(actual, expected, reference, atol, rtol, guarded):
                    raise
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: structure differs"
        refs = reference if isinstance(reference, (list, tuple)) and len(reference) == len(expected) else [None] * len(expected)
        for i, (a, e, r) in enumerate(zip(actual, expected, refs)):
            compare(a, e, dtype, values, f"{where}[{i}]", r, guarded)
    elif isinstance(expected, float) and values:
        assert abs(actual - expected) <= 1e-5 + 1e-5 * abs(expected) or (actual != actual and expected != expected)
    elif values:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _as_accurate_as_torch(actual, expected, reference, atol, rtol, guarded=True):
    """Whether ``actual`` is as close to the float64 ``reference`` as torch's ``expected`` is (see `compare`),
    where torch's own error is a rounding error (at most ten times the relative tolerance)."""
    if not (isinstance(reference, torch.Tensor) and reference.shape == expected.shape
            and (expected.is_floating_point() or expected.is_complex())):
        return False
    wide = torch.complex128 if expected.is_complex() else torch.float64
    ours, torchs, ref = actual.to(wide), expected.to(wide), reference.detach().to(wide)
    finite = torch.isfinite(torchs)
    if not torch.equal(finite, torch.isfinite(ours)) or not torch.equal(ours[~finite].isnan(), torchs[~finite].isnan()):
        return False
    if not torch.equal(ours[~finite & ~torchs.isnan()], torchs[~finite & ~torchs.isnan()]):  # infinities' signs
        return False
    if not bool(finite.any()):
        return True
    err = (ours - ref).abs()[finite]
    torch_err = (torchs - ref).abs()[finite]
    scale = ref.abs()[finite]
    if bool((err <= atol + rtol * scale).all()):
        return True
    if torch_err.isnan().any() or guarded and torch_err.max() > atol + 10 * rtol * scale.max():
        return False
    bound = atol + rtol * scale + 2 * torch_err.max()
    return bool((err <= bound).all())


def _float64(x):
    """``x`` with its floating and complex tensors in double precision (the reference run of `compare`)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            return x.detach().double()
        return x.detach().to(torch.complex128) if x.is_complex() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_float64(v) for v in x)
    if isinstance(x, dict):
        return {k: _float64(v) for k, v in x.items()}
    return x


def _reference(op, sample):
    """The op's result on the sample in float64 on the CPU, or None where that does not run."""
    try:
        return op(_float64(sample.input), *_float64(sample.args), **_float64(sample.kwargs))
    except Exception:  # noqa: BLE001 - the op has no float64 kernel, or the sample needs its own dtype
        return None


def _reference_grads(op, sample):
    """`grads` of the sample in float64 on the CPU (the reference of `compare`), or None."""

    def wide(x):
        y = _float64(x)
        return y.requires_grad_() if isinstance(x, torch.Tensor) and x.requires_grad else y

    tree = jax.tree_util.tree_map(wide, (sample.input, sample.args, sample.kwargs),
                                  is_leaf=lambda x: isinstance(x, torch.Tensor))
    try:
        return grads(op, SampleInput(tree[0], args=tree[1], kwargs=tree[2]), "cpu")
    except Exception:  # noqa: BLE001 - the op has no float64 kernel, or the sample needs its own dtype
        return None


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


def _args(op, sample):
    return sample.args if op.name in HOST_ARGS else _to_jax(sample.args)


def run_eager(op, sample):
    return op(_to_jax(sample.input), *_args(op, sample), **_to_jax(sample.kwargs))


def run_jit(op, sample):
    """Run the op inside jax.jit: tensors in the sample become traced arguments and random
    ops draw from a traced key; results that are not tensors (sizes, ``item()``'s traced
    numbers) come back as Python values."""
    host = op.name in HOST_ARGS
    inputs = _to_jax((sample.input, sample.kwargs, () if host else sample.args))
    leaves, treedef = jax.tree_util.tree_flatten(inputs, is_leaf=lambda x: isinstance(x, torch.Tensor))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
    out = {}

    def traced(o):
        return isinstance(o, Tensor) or is_traced_number(o)

    def fn(key, *arrays):
        filled = list(leaves)
        for i, a in zip(positions, arrays):
            filled[i] = _rebuild(leaves[i], _tensor_of(a, _storage(leaves[i]).dtype))
        inp, kwargs, args = jax.tree_util.tree_unflatten(treedef, filled)
        with torch2jax.rng_key(key):
            result = op(inp, *(sample.args if host else args), **kwargs)
        out_leaves, out["tree"] = jax.tree_util.tree_flatten(result, is_leaf=lambda x: isinstance(x, torch.Tensor))
        # a traced output's place holds its dtype (a tensor) or None (a number)
        out["leaves"] = [(o if not traced(o) else _Traced(o.dtype if isinstance(o, Tensor) else None)) for o in out_leaves]
        return [o.jax() if isinstance(o, Tensor) else value_of(o) for o in out_leaves if traced(o)]

    with jax.enable_x64(True):
        arrays = iter(jax.jit(fn)(jax.random.key(0), *[_storage(leaves[i]).jax() for i in positions]))
    results = [
        (_tensor_of(next(arrays), o.dtype) if o.dtype else next(arrays).item()) if isinstance(o, _Traced) else o
        for o in out["leaves"]
    ]
    return jax.tree_util.tree_unflatten(out["tree"], results)


class _Traced(typing.NamedTuple):
    dtype: torch.dtype | None


def _tensor_of(array, dtype):
    """The jax tensor of ``array`` as a tensor of ``dtype`` (complex32 is held as complex64)."""
    return retag(new_tensor(array)) if dtype is torch.complex32 else new_tensor(array)


def run_t2j_jit(op, sample):
    """Run the op through ``t2j.jit`` as a user would: one jitted function per sample,
    called with the sample's tensors on the jax device (traced) and its other values
    (static). A trace that stops at a value-dependent op runs eagerly, as t2j.jit does."""
    fn = torch2jax.jit(lambda *a, **k: op(*a, **k))
    return fn(_to_jax(sample.input), *_args(op, sample), **_to_jax(sample.kwargs))


RUNNERS = {"eager": run_eager, "jit": run_jit, "t2j_jit": run_t2j_jit}


def _draws_random(op, sample):
    """Whether the sample's values are random: a random op, or attention with dropout."""
    if op.name in RANDOM_OPS or sample.kwargs.get("dropout_p", 0) > 0:
        return True
    if op.name == "svd_lowrank" and sample.kwargs.get("M") is not None:
        # exact only when the matrix has rank <= q; past that, the approximation follows the random projection
        a = sample.input @ sample.args[0].mT - sample.kwargs["M"]
        return bool((torch.linalg.matrix_rank(a.detach()) > sample.kwargs["q"]).any())
    # multi_head_attention_forward(query, key, value, ..., dropout_p (10th), ..., training=True)
    return op.name == "nn.functional.multi_head_attention_forward" and sample.kwargs.get("training", True) \
        and sample.args[9] > 0


class _Reconstructed:
    """A SIGN_FREE op whose result is (U diag(S) V^H, S, U^H U, V^H V). ``thin``: U and V
    cut to their first k = len(S) columns, for gradients: with full_matrices the other
    columns are any basis of the complement, and a loss that reads them has no defined
    gradient (torch's own depends on LAPACK's pick)."""

    def __init__(self, op, thin=False):
        self.op, self.name, self.thin = op, op.name, thin

    def __call__(self, *args, **kwargs):
        u, s, v = self.op(*args, **kwargs)
        if SIGN_FREE[self.name]:
            v = v.mH
        k = s.shape[-1]
        product = (u[..., :k] * s.unsqueeze(-2).to(u.dtype)) @ v[..., :k].mH
        if self.thin:
            u, v = u[..., :k], v[..., :k]
        return product, s, u.mH @ u, v.mH @ v


class _PhaseFixed:
    """A PHASE_FREE op whose eigenvectors are scaled to a canonical phase."""

    def __init__(self, op):
        self.op, self.name = op, op.name

    def __call__(self, *args, **kwargs):
        values, vectors = self.op(*args, **kwargs)
        if vectors.numel() == 0:
            return values, vectors
        pick = vectors.abs().argmax(dim=-2, keepdim=True)
        lead = vectors.gather(-2, pick)
        return values, vectors * (lead.conj() / lead.abs())


def check_sample(op, sample, dtype, mode, where=""):
    """Run one sample in `mode` (eager, jit, t2j_jit or grad) and assert it matches torch CPU.

    Returns False when the sample does not apply: torch cannot differentiate
    it. Where torch rejects a sample in eager or jit mode, we must reject it too.
    """
    if op.name in SIGN_FREE:
        op = _Reconstructed(op, thin=mode == "grad")
    elif op.name in PHASE_FREE:
        op = _PhaseFixed(op)
    values = not _draws_random(op, sample)
    if mode == "grad":
        try:
            expected = grads(op, sample, "cpu")
        except Exception:  # noqa: BLE001 - torch cannot differentiate this sample
            return False
        if expected is None:
            return False
        actual = [_to_cpu(a) if a is not None else None for a in grads(op, sample, "jax")]
        try:
            compare(actual, list(expected), dtype, values, where)
        except AssertionError:
            reference = _reference_grads(op, sample) if values else None
            if reference is None:
                raise
            compare(actual, list(expected), dtype, values, where, list(reference), guarded=False)
        return True
    try:
        expected = op(sample.input, *sample.args, **sample.kwargs)
    except Exception:  # noqa: BLE001
        try:
            (run_t2j_jit if mode == "t2j_jit" else run_eager)(op, sample)
        except Exception:  # noqa: BLE001
            return True
        raise AssertionError(f"{where}: torch raises for this sample but torch2jax does not") from None
    actual = _to_cpu(RUNNERS[mode](op, sample))
    if op.name in TIE_OPS:
        actual = _same_picks(op, sample, actual, expected)
    try:
        compare(actual, expected, dtype, values, where)
    except AssertionError:
        reference = _reference(op, sample) if values else None
        if reference is None:
            raise
        compare(actual, expected, dtype, values, where, reference)
    return True


def _same_picks(op, sample, actual, expected):
    """``actual`` with its indices replaced by torch's where both pick equal values of the input."""
    args, kwargs, x = sample.args, sample.kwargs, sample.input.detach()
    lead, keep = TIE_OPS[op.name]
    if kwargs.get("stable") or x.ndim == 0:
        return actual
    dim = kwargs.get("dim", args[lead] if len(args) > lead else -1)
    keepdim = keep is None or kwargs.get("keepdim", args[keep] if len(args) > keep else False)
    mine, torchs = (actual, expected) if op.name == "argsort" else (actual[1], expected[1])
    if not (isinstance(mine, torch.Tensor) and mine.shape == torchs.shape and mine.dtype == torchs.dtype):
        return actual
    if not keepdim:
        mine, torchs = mine.unsqueeze(dim), torchs.unsqueeze(dim)
    try:
        a, e = x.take_along_dim(mine, dim), x.take_along_dim(torchs, dim)
    except (IndexError, RuntimeError):
        return actual
    if not bool(((a == e) | (a.isnan() & e.isnan())).all()):
        return actual
    return expected if op.name == "argsort" else [actual[0], expected[1]]


def grads(op, sample, device):
    """Gradients of sum(out * weights) (its real part for complex outputs) with respect to every
    floating or complex input tensor."""
    inputs = (sample.input, sample.args, sample.kwargs)
    if device == "jax":
        inputs = (_to_jax(sample.input), _args(op, sample), _to_jax(sample.kwargs))
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
        # complex weights for a complex output, so that the gradient of both parts is checked
        weight_dtype = torch.complex128 if o.is_complex() else torch.float64
        w = torch.randn(o.shape, generator=gen, dtype=weight_dtype).to(o.device, o.dtype)
        total = total + (o * w).sum().real if o.is_complex() else total + (o * w).sum()
    return torch.autograd.grad(total, leaves, allow_unused=True)
