"""PyTorch's OpInfo database against torch CPU: eager, inside jax.jit, and gradients.

Every (op, dtype, mode) is a test (CI runs the eager ones; jit and grad are
marked slow); known failures are listed with their reason
in tests/opinfo_xfails.py and marked xfail(strict=True), so a fix shows up as
an XPASS failure. `python tools/op_coverage.py` re-runs everything and rewrites
both that list and docs/op_coverage.md.
"""

from __future__ import annotations

import pytest
import torch

from opinfo_util import DTYPES, check_sample, cpu_ops, samples
from opinfo_xfails import CRASHES, XFAIL

OPS = cpu_ops()
JIT_DTYPES = ("float32", "float16", "int64", "int32", "bool", "bfloat16", "complex64")
# eager cases that take half a minute or more each (half-precision transposed 3-d
# convolution rounds per kernel tap, as torch CPU does): run with the slow set
SLOW_EAGER = {"nn.functional.conv_transpose3d|bfloat16|eager", "nn.functional.conv_transpose3d|float16|eager"}


def cases():
    for name, op in sorted(OPS.items()):
        supported = op.supported_dtypes("cpu")
        for dname, dtype in DTYPES.items():
            if dtype not in supported:
                continue
            modes = ["eager"]
            if dname in JIT_DTYPES:
                modes.append("jit")
            if dname == "float32" and op.supports_autograd:
                modes.append("grad")
            for mode in modes:
                key = f"{name}|{dname}|{mode}"
                marks = [pytest.mark.xfail(strict=True, reason=XFAIL[key])] if key in XFAIL else []
                if key in CRASHES:
                    marks = [pytest.mark.skip(reason=CRASHES[key])]
                if mode != "eager" or key in SLOW_EAGER:
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
