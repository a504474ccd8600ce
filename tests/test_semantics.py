"""torch semantics that OpInfo samples rarely reach: type promotion with Python
scalars and zero-dim tensors, integer division and overflow, NaN / inf, empty
tensors, broadcasting."""

from __future__ import annotations

import itertools

import pytest
import torch

import torch2jax  # noqa: F401

DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


def _make(dtype, shape):
    if dtype == torch.bool:
        return torch.tensor([True, False, True])[: shape[0]].reshape(shape) if shape else torch.tensor(True)
    return (torch.arange(1, 4) if shape else torch.tensor(2)).to(dtype).reshape(shape)


def _promotion_cases():
    for da, db, zero_dim in itertools.product(DTYPES, DTYPES, (False, True)):
        result = torch.result_type(_make(da, (3,)), _make(db, () if zero_dim else (3,)))
        marks = [pytest.mark.xfail(strict=True, reason="complex32 has no JAX dtype")] if result == torch.complex32 else []
        yield pytest.param(da, db, zero_dim, marks=marks)


@pytest.mark.parametrize("da,db,zero_dim", list(_promotion_cases()))
def test_binary_promotion(da, db, zero_dim):
    a = _make(da, (3,))
    b = _make(db, () if zero_dim else (3,))
    for op in (torch.add, torch.mul):
        expected = op(a, b)
        actual = op(a.to("jax"), b.to("jax"))
        assert actual.dtype == expected.dtype, (op, da, db)
        torch.testing.assert_close(actual.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scalar", [2, 2.5, True, 1 + 2j])
def test_python_scalar_promotion(dtype, scalar):
    a = _make(dtype, (3,))
    try:
        expected = a * scalar
    except RuntimeError:
        return
    if expected.dtype == torch.complex32:
        with pytest.raises(RuntimeError, match="complex32"):
            a.to("jax") * scalar
        return
    actual = a.to("jax") * scalar
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected)


def test_integer_division_and_remainder_with_negatives():
    a = torch.tensor([-7, 7, -7, 7, 0])
    b = torch.tensor([2, -2, -2, 2, 3])
    ja, jb = a.to("jax"), b.to("jax")
    for fn in (
        lambda x, y: torch.div(x, y, rounding_mode="floor"),
        lambda x, y: torch.div(x, y, rounding_mode="trunc"),
        lambda x, y: x / y,
        lambda x, y: x // y,
        lambda x, y: x % y,
        torch.fmod,
        torch.remainder,
    ):
        e, r = fn(a, b), fn(ja, jb)
        assert r.dtype == e.dtype
        torch.testing.assert_close(r.cpu(), e)


def test_integer_overflow_wraps():
    a = torch.tensor([2**31 - 1], dtype=torch.int32)
    assert (a.to("jax") + 1).cpu().item() == (a + 1).item()
    b = torch.tensor([250], dtype=torch.uint8)
    assert (b.to("jax") + 10).cpu().item() == (b + 10).item()


def test_nan_and_inf():
    x = torch.tensor([float("nan"), 1.0, float("inf"), -float("inf")])
    jx = x.to("jax")
    torch.testing.assert_close(torch.maximum(jx, jx.flip(0)).cpu(), torch.maximum(x, x.flip(0)), equal_nan=True)
    torch.testing.assert_close(jx.clamp(0, 2).cpu(), x.clamp(0, 2), equal_nan=True)
    assert torch.isnan(jx.max()).item() and torch.isnan(jx.sum()).item()
    torch.testing.assert_close((jx * 0).cpu(), x * 0, equal_nan=True)


def test_empty_and_zero_size():
    x = torch.zeros(0, 3, device="jax")
    assert (x + 1).shape == (0, 3)
    assert x.sum().item() == 0.0
    assert x.sum(0).shape == (3,)
    assert torch.cat([x, torch.ones(2, 3, device="jax")]).shape == (2, 3)


def test_broadcasting():
    a, b = torch.randn(4, 1, 3), torch.randn(5, 1)
    torch.testing.assert_close((a.to("jax") - b.to("jax")).cpu(), a - b)
