"""PyTorch's OpInfo database against torch CPU: eager, inside jax.jit, through t2j.jit, and gradients.

Every (op, dtype, mode) is a test (CI runs the eager ones; jit and grad are
marked slow); known failures are listed with their reason
in tests/opinfo_xfails.py and marked xfail(strict=True), so a fix shows up as
an XPASS failure. `python tools/op_coverage.py` re-runs everything and rewrites
both that list and docs/op_coverage.md.

The t2j_jit mode (`test_opinfo_t2j_jit`, all slow) runs each sample through
``t2j.jit`` as a user would. Its cases are not in `cases()`, so op_coverage.py
neither runs them nor gives them strict xfails: a case whose eager mode is a known
failure is a non-strict xfail (a crash in eager or jit mode: skipped), the rest
fail plainly. Their pass rates and failure classes are measured by
``python tools/opinfo_t2j_jit.py`` (docs/opinfo_t2j_jit.json).
"""

from __future__ import annotations

import pytest
import torch

from opinfo_util import DTYPES, check_sample, cpu_ops, samples
from opinfo_xfails import CRASHES, XFAIL

OPS = cpu_ops()
JIT_DTYPES = ("float32", "float64", "float16", "int64", "int32", "bool", "bfloat16", "complex64", "complex32")
# eager cases that take half a minute or more each (half-precision transposed 3-d
# convolution rounds per kernel tap, as torch CPU does): run with the slow set
SLOW_EAGER = {"grid_sampler_3d|bfloat16|eager", "nn.functional.conv_transpose3d|bfloat16|eager", "nn.functional.conv_transpose3d|float16|eager",
              "nn.functional.conv_transpose3d|complex64|eager", "istft|complex64|eager",
              "nn.functional.ctc_loss|float32|eager", "nn.functional.interpolate.trilinear|float32|eager",
              "nn.functional.interpolate.trilinear|bfloat16|eager", "nn.functional.conv_transpose2d|bfloat16|eager",
              "nn.functional.conv_transpose2d|float16|eager"}


# gradients are checked in torch's autograd dtypes: float32, and float64 (gradcheck's); also in
# complex64 for the ops whose OpInfo lists it among their backward dtypes
GRAD_DTYPES = ("float32", "float64")

# dtypes whose eager cases run with the slow set (CI time); float64 runs in CI (and int64 for the
# integers, complex64 for the complex dtypes)
SLOW_DTYPES = {"complex128", "uint8", "int8", "int16", "int32", "complex32"}

# CI runs every op's float32 eager case and, for every fourth op, its case in one of the other CI dtypes,
# rotating in this order, so that each dtype meets a twenty-fourth of the ops (CI time; the rest run in the
# slow set)
ROTATED_DTYPES = ("float64", "bfloat16", "float16", "int64", "bool", "complex64")


def _rotated_out(op_index: int, dname: str) -> bool:
    period = 4 * len(ROTATED_DTYPES)
    return dname in ROTATED_DTYPES and (op_index + 4 * ROTATED_DTYPES.index(dname)) % period != 0


def cases():
    for op_index, (name, op) in enumerate(sorted(OPS.items())):
        supported = op.supported_dtypes("cpu")
        for dname, dtype in DTYPES.items():
            if dtype not in supported:
                continue
            modes = ["eager"]
            if dname in JIT_DTYPES:
                modes.append("jit")
            if op.supports_autograd and (dname in GRAD_DTYPES or dname == "complex64"
                                         and dtype in op.supported_backward_dtypes("cpu")):
                modes.append("grad")
            for mode in modes:
                key = f"{name}|{dname}|{mode}"
                marks = [pytest.mark.xfail(strict=True, reason=XFAIL[key])] if key in XFAIL else []
                if key in CRASHES:
                    marks = [pytest.mark.skip(reason=CRASHES[key])]
                if mode != "eager" or key in SLOW_EAGER or dname in SLOW_DTYPES or _rotated_out(op_index, dname):
                    marks.append(pytest.mark.slow)
                yield pytest.param(name, dname, mode, id=key, marks=marks)


def check(name, dname, mode):
    op, dtype = OPS[name], DTYPES[dname]
    torch.manual_seed(0)  # the same samples whatever ran before in this process
    for i, s in enumerate(samples(op, dtype, requires_grad=mode == "grad")):
        check_sample(op, s, dtype, mode, f"{name} {dname} {mode} sample {i}")


@pytest.mark.parametrize("name,dname,mode", list(cases()))
def test_opinfo(name, dname, mode):
    check(name, dname, mode)


# ops whose samples pass a sparse tensor as the argument, which t2j.jit refuses (it takes dense ones)
T2J_JIT_SPARSE_ARGUMENTS = {"sparse.mm.reduce", "sparse.sampled_addmm"}


def t2j_jit_cases():
    """(op, dtype) cases of the t2j_jit mode: every op on the jit mode's dtypes, all slow."""
    for name, op in sorted(OPS.items()):
        supported = op.supported_dtypes("cpu")
        for dname in JIT_DTYPES:
            if DTYPES[dname] not in supported:
                continue
            marks = [pytest.mark.slow]
            eager, jit = f"{name}|{dname}|eager", f"{name}|{dname}|jit"
            if eager in XFAIL:
                marks.append(pytest.mark.xfail(strict=False, reason=f"eager fails: {XFAIL[eager]}"))
            if name in T2J_JIT_SPARSE_ARGUMENTS:
                marks.append(pytest.mark.xfail(strict=True, reason="t2j.jit takes dense arguments only"))
            if eager in CRASHES or jit in CRASHES:
                marks.append(pytest.mark.skip(reason=CRASHES.get(eager) or CRASHES[jit]))
            yield pytest.param(name, dname, "t2j_jit", id=f"{name}|{dname}|t2j_jit", marks=marks)


@pytest.mark.parametrize("name,dname,mode", list(t2j_jit_cases()))
def test_opinfo_t2j_jit(name, dname, mode):
    check(name, dname, mode)
