"""Inputs torch's CPU kernels reject: the jax device raises the same builtin exception type with
the same message (many from OpInfo's error_inputs), and the split ops' list out= is written as
on CPU."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch2jax  # noqa: F401  (registers the jax device)


def _x(*shape, dtype=None):
    return lambda d: torch.randn(*shape, dtype=dtype, device=d)


CASES = {
    "abs_ complex": lambda d: torch.tensor([1 + 2j], device=d).abs_(),
    "avg_pool1d negative pad": lambda d: F.avg_pool1d(_x(1, 1, 6)(d), 2, padding=-1),
    "avg_pool1d pad over half": lambda d: F.avg_pool1d(_x(1, 1, 6)(d), 2, padding=2),
    "max_pool1d indices pad": lambda d: F.max_pool1d(_x(1, 1, 6)(d), 2, padding=2, return_indices=True),
    "max_pool2d pad over half": lambda d: F.max_pool2d(_x(1, 1, 6, 6)(d), 2, padding=4),
    "max_pool2d pad over half kernel": lambda d: F.max_pool2d(_x(1, 1, 6, 6)(d), 2, padding=2, dilation=3),
    "max_pool2d dilation 0": lambda d: F.max_pool2d(_x(1, 1, 6, 6)(d), 2, dilation=0),
    "max_pool2d empty channels": lambda d: F.max_pool2d(_x(1, 0, 2, 2)(d), 1),
    "max_pool2d 2-d input": lambda d: F.max_pool2d(_x(2, 2)(d), 1),
    "max_pool3d empty dim": lambda d: F.max_pool3d(_x(0, 1, 2, 10)(d), 1),
    "max_pool3d pad over half kernel": lambda d: F.max_pool3d(_x(1, 1, 6, 6, 6)(d), 2, padding=(0, 1, 2), dilation=3),
    "avg_pool2d divisor 0": lambda d: F.avg_pool2d(_x(1, 1, 6, 6)(d), 2, divisor_override=0),
    "avg_pool2d 1-d input": lambda d: F.avg_pool2d(_x(6)(d), 1),
    "avg_pool3d divisor 0": lambda d: F.avg_pool3d(_x(1, 1, 4, 6, 6)(d), 2, divisor_override=0),
    "avg_pool3d empty dim": lambda d: F.avg_pool3d(_x(0, 1, 2, 10)(d), 1),
    "adaptive_max_pool2d 3 sizes": lambda d: F.adaptive_max_pool2d(_x(1, 2, 4, 4)(d), (2, 2, 2)),
    "adaptive_max_pool3d 2 sizes": lambda d: F.adaptive_max_pool3d(_x(1, 1, 4, 6, 6)(d), (2, 2)),
    "adaptive_max_pool3d empty dim": lambda d: F.adaptive_max_pool3d(_x(1, 0, 1, 2, 2)(d), 1),
    "embedding 1-d weight": lambda d: F.embedding(torch.tensor([0], device=d), _x(4)(d)),
    "embedding 0-d weight": lambda d: F.embedding(torch.tensor([0], device=d), torch.tensor(1.0, device=d)),
    "gelu approximate": lambda d: F.gelu(_x(3)(d), approximate="foo"),
    "huber_loss delta 0": lambda d: F.huber_loss(_x(3)(d), _x(3)(d), delta=0.0),
    "smooth_l1_loss negative beta": lambda d: F.smooth_l1_loss(_x(3)(d), _x(3)(d), beta=-1.0),
    "softshrink negative lambda": lambda d: F.softshrink(_x(3)(d), -0.5),
    "softshrink lambda past half": lambda d: F.softshrink(_x(3, dtype=torch.float16)(d), 1e5),
    "softshrink integers": lambda d: F.softshrink(torch.tensor([1, 2], device=d), 0.5),
    "native_layer_norm []": lambda d: torch.native_layer_norm(_x(3)(d), [], None, None, 1e-5),
    "roll 0-d": lambda d: torch.roll(torch.tensor(1.0, device=d), 1, 0),
    "roll 0-d dim -1": lambda d: torch.roll(torch.tensor(1.0, device=d), 1, -1),
    "roll no shifts": lambda d: torch.roll(_x(2)(d), [], []),
    "histogramdd bins": lambda d: torch.histogramdd(_x(4, 2)(d), bins=[2, 2, 2]),
    "histogramdd 1-d input": lambda d: torch.histogramdd(_x(4)(d), bins=[2]),
    "histogramdd bin tensors": lambda d: torch.histogramdd(_x(4, 2)(d), bins=[torch.tensor([0.0, 1.0], device=d)]),
    "masked_fill complex into long": lambda d: torch.tensor([1, 1], device=d).masked_fill(
        torch.tensor(False, device=d), torch.tensor(1j, device=d)),
    "masked_fill_ 1e20 into long": lambda d: torch.tensor([1, 1], device=d).masked_fill_(
        torch.tensor([True, False], device=d), torch.tensor(1e20, device=d)),
    "masked_fill 300 into uint8": lambda d: torch.ones(2, dtype=torch.uint8, device=d).masked_fill(
        torch.tensor(True, device=d), torch.tensor(300, device=d)),
    "masked_fill 1e300 into float": lambda d: torch.ones(2, device=d).masked_fill(
        torch.tensor(True, device=d), torch.tensor(1e300, dtype=torch.float64, device=d)),
    "complex out complex128": lambda d: torch.complex(_x(2)(d), _x(2)(d), out=torch.empty(2, dtype=torch.complex128, device=d)),
    "complex out float": lambda d: torch.complex(_x(2)(d), _x(2)(d), out=torch.empty(2, device=d)),
    "polar out complex128": lambda d: torch.polar(_x(2)(d), _x(2)(d), out=torch.empty(2, dtype=torch.complex128, device=d)),
    "complex float, int": lambda d: torch.complex(_x(2)(d), torch.ones(2, dtype=torch.int32, device=d)),
    "polar float, double": lambda d: torch.polar(_x(2)(d), _x(2, dtype=torch.float64)(d)),
    "multinomial out double": lambda d: torch.multinomial(torch.ones(3, device=d), 2,
                                                          out=torch.empty(2, dtype=torch.float64, device=d)),
    "amax empty": lambda d: torch.amax(_x(0, 3)(d)),
    "amin empty": lambda d: torch.amin(_x(0, 3)(d), []),
    "aminmax empty dim": lambda d: torch.aminmax(_x(3, 0)(d), dim=1),
    "narrow_copy 0-d": lambda d: torch.narrow_copy(torch.tensor(1.0, device=d), 0, 0, 1),
    "narrow_copy dim past": lambda d: torch.narrow_copy(_x(3)(d), 1, 0, 1),
    "unbind_copy 0-d": lambda d: torch.unbind_copy(torch.tensor(1.0, device=d)),
    "cat out long": lambda d: torch.cat([_x(2)(d), _x(2)(d)], out=torch.empty(0, dtype=torch.long, device=d)),
    "stack out bool": lambda d: torch.stack([_x(2)(d)], out=torch.empty(0, dtype=torch.bool, device=d)),
    "hstack out long": lambda d: torch.hstack([_x(2)(d)], out=torch.empty(0, dtype=torch.long, device=d)),
    "vstack out long": lambda d: torch.vstack([_x(2)(d)], out=torch.empty(0, dtype=torch.long, device=d)),
    "dstack out long": lambda d: torch.dstack([_x(2)(d)], out=torch.empty(0, dtype=torch.long, device=d)),
    "column_stack out long": lambda d: torch.column_stack([_x(2)(d)], out=torch.empty(0, dtype=torch.long, device=d)),
    "cat complex out float": lambda d: torch.cat([_x(2, dtype=torch.complex64)(d)], out=torch.empty(0, device=d)),
    "unbind_copy out count": lambda d: torch.unbind_copy(_x(3, 2)(d), out=[torch.empty(0, device=d)] * 2),
    "split_with_sizes_copy out dtype": lambda d: torch.split_with_sizes_copy(
        _x(3, 2)(d), [1, 2], out=[torch.empty(0, dtype=torch.long, device=d)] * 2),
    "index_add 1-d out of range": lambda d: torch.zeros(4, device=d).index_add(
        0, torch.tensor([5], device=d), torch.ones(1, device=d)),
    "index_add 2-d out of range": lambda d: torch.zeros(3, 4, device=d).index_add(
        1, torch.tensor([5], device=d), torch.ones(3, 1, device=d)),
    "index tensors not broadcasting": lambda d: _x(4, 5)(d)[torch.tensor([0, 1], device=d),
                                                           torch.tensor([0, 1, 2], device=d)],
    "mask and index not broadcasting": lambda d: _x(3, 5)(d)[torch.tensor([True] * 3, device=d),
                                                            torch.tensor([0, 1], device=d)],
    "setitem uint8 mask": lambda d: _x(3)(d).__setitem__(torch.tensor([1, 0, 1], dtype=torch.uint8, device=d), 2.0),
    "fill_ -0.5 into uint8": lambda d: torch.zeros(2, dtype=torch.uint8, device=d).fill_(-0.5),
    "poisson negative rate": lambda d: torch.poisson(torch.tensor([-1.0, 2.0], device=d)),
    "poisson nan rate": lambda d: torch.poisson(torch.tensor([float("nan")], device=d)),
    "poisson long": lambda d: torch.poisson(torch.tensor([3], device=d)),
    "bernoulli long p": lambda d: torch.bernoulli(torch.tensor([1, 0], device=d)),
    "bernoulli complex p": lambda d: torch.bernoulli(torch.tensor([0.5 + 0j], device=d)),
    "bernoulli_ complex self": lambda d: torch.zeros(2, dtype=torch.complex64, device=d).bernoulli_(
        torch.tensor([0.5], device=d)),
    "binomial long count": lambda d: torch.binomial(torch.full((2,), 10, device=d), torch.full((2,), 0.3, device=d)),
    "binomial double count": lambda d: torch.binomial(torch.full((2,), 10.0, dtype=torch.float64, device=d),
                                                      torch.full((2,), 0.3, device=d)),
    "binomial half": lambda d: torch.binomial(torch.full((2,), 10.0, dtype=torch.float16, device=d),
                                              torch.full((2,), 0.3, dtype=torch.float16, device=d)),
    "random_ from 2**24 float": lambda d: torch.empty(5, device=d).random_(2**24, None),
    "random_ from 256 bfloat16": lambda d: torch.empty(5, dtype=torch.bfloat16, device=d).random_(256, None),
    "normal shapes": lambda d: torch.normal(torch.zeros(4, device=d), torch.ones(6, device=d)),
    "grid_sample grid size 3": lambda d: F.grid_sample(_x(2, 3, 5, 6)(d), torch.rand(2, 4, 7, 3, device=d),
                                                       align_corners=False),
    "grid_sample batch": lambda d: F.grid_sample(_x(2, 3, 5, 6)(d), torch.rand(1, 4, 7, 2, device=d),
                                                 align_corners=False),
    "grid_sample 5-d grid": lambda d: F.grid_sample(_x(2, 3, 5, 6)(d), torch.rand(2, 4, 7, 2, 2, device=d),
                                                    align_corners=False),
    "grid_sampler grid dtype": lambda d: torch.grid_sampler_2d(_x(2, 3, 5, 6)(d),
                                                               torch.rand(2, 4, 7, 2, dtype=torch.float64, device=d),
                                                               0, 0, False),
    "embedding_bag index past": lambda d: F.embedding_bag(torch.tensor([1, 12], device=d), _x(10, 4)(d),
                                                          torch.tensor([0], device=d)),
    "embedding_bag negative index": lambda d: F.embedding_bag(torch.tensor([1, -1], device=d), _x(10, 4)(d),
                                                              torch.tensor([0], device=d)),
    "abs bool": lambda d: torch.abs(torch.tensor([True], device=d)),
    "sdpa causal and a mask needing grad": lambda d: F.scaled_dot_product_attention(
        *(_x(1, 2, 5, 8)(d) for _ in range(3)), attn_mask=_x(5, 5)(d).requires_grad_(), is_causal=True),
    "sdpa causal and mask, 3-d": lambda d: F.scaled_dot_product_attention(
        *(_x(2, 5, 8)(d) for _ in range(3)), attn_mask=_x(5, 5)(d), is_causal=True),
    "sdpa key of another dtype": lambda d: F.scaled_dot_product_attention(
        _x(1, 2, 3, 4)(d), _x(1, 2, 5, 4)(d).double(), _x(1, 2, 5, 4)(d)),
    "sdpa 1-d query": lambda d: F.scaled_dot_product_attention(_x(4)(d), _x(5, 4)(d), _x(5, 4)(d)),
    "sdpa long mask": lambda d: F.scaled_dot_product_attention(
        *(_x(1, 2, 3, 4)(d) for _ in range(3)), attn_mask=torch.ones(3, 3, dtype=torch.long, device=d)),
    "sdpa integers": lambda d: F.scaled_dot_product_attention(
        *(torch.ones(1, 2, 3, 4, dtype=torch.int32, device=d) for _ in range(3))),
    "sdpa complex": lambda d: F.scaled_dot_product_attention(
        *(_x(1, 2, 3, 4)(d).to(torch.complex64) for _ in range(3))),
    "sdpa mask of another length": lambda d: F.scaled_dot_product_attention(
        _x(1, 2, 3, 4)(d), _x(1, 2, 5, 4)(d), _x(1, 2, 5, 4)(d), attn_mask=_x(1, 1, 4, 5)(d)),
}



def _builtin(e):
    """The builtin exception class ``e`` is (torch2jax raises subclasses of them)."""
    return next(c for c in type(e).__mro__ if c.__module__ == "builtins")


def _error(fn, device):
    with pytest.raises(Exception) as info:  # noqa: PT011 - any type: compared below
        fn(device)
    return info.value


@pytest.mark.parametrize("name", list(CASES))
def test_same_error_as_cpu(name):
    expected, got = _error(CASES[name], "cpu"), _error(CASES[name], "jax")
    assert _builtin(got) is _builtin(expected), f"{type(got).__name__}: {got}"
    assert str(got) == str(expected)


LIST_OUT = {
    "unbind_copy": (3, lambda x, out: torch.unbind_copy(x, out=out)),
    "unbind_copy dim 1": (2, lambda x, out: torch.unbind_copy(x, 1, out=out)),
    "split_with_sizes_copy": (2, lambda x, out: torch.split_with_sizes_copy(x, [1, 2], out=out)),
    "split_copy": (2, lambda x, out: torch.split_copy(x, 2, out=out)),
}


@pytest.mark.parametrize("shape", [(0,), (9,), (2, 2)])
@pytest.mark.parametrize("name", list(LIST_OUT))
def test_list_out(name, shape):
    n, fn = LIST_OUT[name]
    results = []
    for device in ("cpu", "jax"):
        out = [torch.zeros(shape, device=device) for _ in range(n)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (resizing a non-empty out)
            try:
                fn(torch.arange(6.0).reshape(3, 2).to(device), out)
            except RuntimeError as e:  # split_copy copies into out without resizing it
                results.append(str(e))
                continue
        results.append([o.cpu() for o in out])
    expected, got = results
    if isinstance(expected, str):
        assert got == expected
    else:
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("lengths", [[2, 4, 1], [3, 2, 0]])
def test_pack_padded_sequence_errors_as_torch(lengths):
    from torch.nn.utils.rnn import pack_padded_sequence

    errors = []
    for device in ("cpu", "jax"):
        with pytest.raises(RuntimeError) as caught:
            pack_padded_sequence(torch.randn(5, 3, 2, device=device), lengths)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
