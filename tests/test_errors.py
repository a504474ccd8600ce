"""Bad input and missing lowerings: clear errors naming the op, one-time host-fallback warnings."""

from __future__ import annotations

import warnings

import jax
import pytest
import torch

import torch2jax as t2j
from torch2jax.tensor import new_tensor

_lib = torch.library.Library("t2jtest", "DEF")
_lib.define("double_it(Tensor x) -> Tensor")
_lib.impl("double_it", lambda x: x * 2, "CPU")
_lib.impl("double_it", lambda x: torch.empty_like(x), "Meta")


def test_unlowered_op_falls_back_to_host_with_one_warning():
    x = torch.arange(4.0, device="jax")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = torch.ops.t2jtest.double_it(x)
        z = torch.ops.t2jtest.double_it(y)
    assert isinstance(z, t2j.Tensor)
    assert z.cpu().tolist() == [0.0, 4.0, 8.0, 12.0]
    msgs = [str(m.message) for m in w if "t2jtest.double_it" in str(m.message)]
    assert len(msgs) <= 1  # once per process: an earlier test may have triggered it
    assert t2j.path_of(torch.ops.t2jtest.double_it.default) == "fallback"


def test_host_fallback_works_under_jit():
    def f(a):
        return torch.ops.t2jtest.double_it(new_tensor(a)).jax() + 1

    with jax.enable_x64(True):
        out = jax.jit(f)(jax.numpy.arange(3.0))
    assert out.tolist() == [1.0, 3.0, 5.0]


def test_fallback_error_mode_names_the_op():
    with t2j.env(fallback="error"):
        with pytest.raises(t2j.OpError, match="t2jtest.double_it"):
            torch.ops.t2jtest.double_it(torch.ones(2, device="jax"))


def test_shape_mismatch_gives_torch_message():
    with pytest.raises(RuntimeError, match=r"(size of tensor a \(3\) must match|broadcast a dimension of length 4)"):
        torch.ones(3, device="jax") + torch.ones(4, device="jax")


def test_matmul_shape_mismatch_gives_torch_message():
    with pytest.raises(RuntimeError, match="(cannot be multiplied|same reduction dim)"):
        torch.ones(2, 3, device="jax") @ torch.ones(4, 5, device="jax")


def test_wrong_dtype_gives_torch_message():
    with pytest.raises(RuntimeError, match="(?i)(long|same dtype)"):
        torch.nn.functional.linear(torch.ones(2, 3, device="jax"), torch.ones(4, 3, dtype=torch.long, device="jax"))


def test_view_errors_like_torch():
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        torch.ones(2, 3, device="jax").view(4)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        torch.ones(2, 3, device="jax").t().view(6)


def test_index_out_of_range_raises():
    x = torch.arange(5, device="jax")
    with pytest.raises(IndexError):
        x[10]
    with pytest.raises((IndexError, RuntimeError), match="out of"):
        x[torch.tensor([1, 7], device="jax")]


def test_item_inside_jit_is_a_clear_error():
    def f(a):
        return new_tensor(a).sum().item()

    with pytest.raises(Exception, match="(?i)concrete|trac"):
        jax.jit(f)(jax.numpy.ones(3))
