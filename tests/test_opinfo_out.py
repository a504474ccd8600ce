"""``out=`` tensors of another dtype than the result's, for every OpInfo op with an out= variant.

torch's kernels differ in what they accept: pointwise ops cast into any dtype the result
can be cast to, many others (``neg``, ``sort``, ``amax``, ``index_select``, the linalg
family) take only the result's exact dtype, and reductions such as ``sum`` compute in
the out's dtype. Whatever the CPU kernel does is the specification: it raises, or it
writes, and then the dtype and values must match.

The ops in ``CI_OPS`` run in CI; the rest are marked slow (each op compiles its own
programs).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from opinfo_util import _to_cpu, _to_jax, cpu_ops

OUT_DTYPES = (torch.float64, torch.int64, torch.complex64)
CI_OPS = {
    "abs", "add", "all", "amax", "any", "clamp", "cross", "cumsum", "frexp", "gather", "heaviside", "index_select",
    "isin", "kthvalue", "linalg.solve", "matmul", "mean", "mm", "nan_to_num", "neg", "round", "searchsorted", "sin",
    "softmax", "sort", "sum", "take", "tril", "where",
}
# random values: only whether it raises, the dtype and the shape are compared
RANDOM = {"bernoulli", "normal", "multinomial", "randn", "rand", "randint", "randn_like", "rand_like"}


def _cases():
    for key, op in sorted(cpu_ops().items()):
        if not op.supports_out or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        for out_dtype in OUT_DTYPES:
            marks = [] if op.name in CI_OPS else [pytest.mark.slow]
            yield pytest.param(key, out_dtype, id=f"{key}|{str(out_dtype)[6:]}", marks=marks)


OPS = cpu_ops()


def _call(op, sample, device, out_dtype):
    """The op with ``out=`` tensors like its result but of ``out_dtype``: the written outs,
    or the exception it raised."""
    inp, args, kwargs = (sample.input, sample.args, sample.kwargs) if device == "cpu" else \
        (_to_jax(sample.input), _to_jax(sample.args), _to_jax(sample.kwargs))
    reference = op(sample.input, *sample.args, **sample.kwargs)
    refs = (reference,) if isinstance(reference, torch.Tensor) else tuple(reference)
    outs = tuple(torch.empty(r.shape, dtype=out_dtype, device=device) for r in refs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            op(inp, *args, out=outs[0] if isinstance(reference, torch.Tensor) else outs, **kwargs)
    except Exception as e:  # noqa: BLE001 - the verdict under test
        return e
    return [_to_cpu(o) for o in outs]


@pytest.mark.parametrize("key,out_dtype", list(_cases()))
def test_out_of_another_dtype(key, out_dtype):
    op = OPS[key]
    try:
        sample = next(iter(op.sample_inputs("cpu", torch.float32)))
        reference = op(sample.input, *sample.args, **sample.kwargs)
    except Exception:  # noqa: BLE001
        pytest.skip("no float32 sample torch runs")
    results = (reference,) if isinstance(reference, torch.Tensor) else reference
    if not isinstance(results, (tuple, list)) or not all(isinstance(r, torch.Tensor) for r in results):
        pytest.skip("the result is not tensors")
    expected = _call(op, sample, "cpu", out_dtype)
    actual = _call(op, sample, "jax", out_dtype)
    if isinstance(expected, Exception):
        assert isinstance(actual, type(expected)), f"torch raises {expected!r}; torch2jax gave {actual!r}"
        return
    assert not isinstance(actual, Exception), f"torch writes the out; torch2jax raised {actual!r}"
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        if op.name not in RANDOM:
            torch.testing.assert_close(a, e, equal_nan=True, atol=1e-4, rtol=1e-4)
