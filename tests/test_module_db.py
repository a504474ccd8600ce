"""PyTorch's ModuleInfo database (``common_modules.module_db``) on the jax device, against torch CPU.

Every module in the database, built from each of its sample constructor inputs, runs
forward and backward eagerly on the jax device, from the same initial weights as its CPU
copy: outputs (values, dtypes, shapes), the gradients of the inputs and parameters, and
the buffers after the call (BatchNorm's running statistics) must match. The database's
error inputs must raise torch's error type with torch's message. The default run takes
float32 and a spread of each module's inputs; the slow set takes every input (up to
`EVERY_SAMPLE_CAP`) in float32 and float64, and a jitted forward and backward (``t2j.jit``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.testing._internal.common_modules import module_db
from torch.utils._pytree import tree_flatten, tree_map

import torch2jax as t2j

MODULES = {m.name: m for m in module_db}
# samples per module and dtype in the default run (LinearCrossEntropyLoss alone has hundreds)
DEFAULT_SAMPLES = 2
EVERY_SAMPLE_CAP = 48  # the slow set's cap (a spread), for the few modules with hundreds
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=5e-5), torch.float64: dict(rtol=1e-7, atol=1e-7)}


def _samples(info, dtype, training, limit):
    samples = [s for s in info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True,
                                                  training=training) if s.forward_input is not None]
    if limit and len(samples) > limit:  # a spread over the list: its variants come in groups
        samples = [samples[round(i * (len(samples) - 1) / (limit - 1))] for i in range(limit)]
    return samples


def _to(x, device):
    if not isinstance(x, torch.Tensor):
        return x
    y = x.detach().to(device)
    return y.requires_grad_(x.requires_grad) if x.is_floating_point() or x.is_complex() else y


def _build(info, sample, dtype, training, cpu_args, cpu_kwargs):
    torch.manual_seed(0)
    module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).to(dtype)
    module.train(training)
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in module.parameters()):
        with torch.no_grad():  # lazy modules take their shapes (and random weights) from a first call
            module(*tree_map(lambda x: _to(x, "cpu"), cpu_args), **tree_map(lambda x: _to(x, "cpu"), cpu_kwargs))
    return module


def _tensors(tree):
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _run(module, args, kwargs, weights=None):
    """Outputs, then gradients of the outputs weighted by ``weights`` (standard normal draws
    where not given) with respect to the inputs and parameters that require grad (None
    where unused), then the weights."""
    out = module(*args, **kwargs)
    differentiable = [o for o in _tensors(out) if o.requires_grad]
    if weights is None:
        g = torch.Generator().manual_seed(1)
        weights = [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in differentiable]
    leaves = [x for x in _tensors((args, kwargs)) if x.requires_grad] + list(module.parameters())
    if not differentiable:
        return out, [], weights
    loss = sum((o * w.to(o.device)).sum() for o, w in zip(differentiable, weights))
    return out, list(torch.autograd.grad(loss, leaves, allow_unused=True)), weights


def _compare(expected, actual, what, tol):
    expected, actual = _tensors(expected), _tensors(actual)
    assert len(expected) == len(actual), what
    for k, (e, a) in enumerate(zip(expected, actual)):
        assert (a.dtype, a.shape) == (e.dtype, e.shape), f"{what} {k}"
        torch.testing.assert_close(a.cpu(), e, equal_nan=True, **tol, msg=lambda m: f"{what} {k}: {m}")


def _check_module(info, dtype, limit, jit=False):
    ran = 0
    for training in (True, False) if info.train_and_eval_differ else (True,):
        for sample in _samples(info, dtype, training, limit):
            args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
            cpu_args, cpu_kwargs = tree_map(lambda x: _to(x, "cpu"), (args, kwargs))
            module = _build(info, sample, dtype, training, args, kwargs)
            on_jax = copy.deepcopy(module).to("jax")
            expected = _run(module, cpu_args, cpu_kwargs)
            jax_args, jax_kwargs = tree_map(lambda x: _to(x, "jax"), (args, kwargs))
            actual = (t2j.jit(_run) if jit else _run)(on_jax, jax_args, jax_kwargs, expected[2])
            where = f"{info.name} {dtype} training={training} {sample.desc!r}"
            _compare(expected[0], actual[0], f"{where}: output", TOLERANCE[dtype])
            assert [g is None for g in expected[1]] == [g is None for g in actual[1]], f"{where}: unused gradients"
            _compare([g for g in expected[1] if g is not None], [g for g in actual[1] if g is not None],
                     f"{where}: gradient", TOLERANCE[dtype])
            _compare(list(module.buffers()), list(on_jax.buffers()), f"{where}: buffer", TOLERANCE[dtype])
            ran += 1
    return ran


# modules whose samples take longest; tests/test_models.py runs them (encoder fast path, attention,
# recurrent and packed recurrent layers) in CI, and the slow set here
SLOW_IN_CI = {"nn.TransformerEncoder", "nn.TransformerEncoderLayer", "nn.TransformerDecoderLayer", "nn.Transformer",
              "nn.MultiheadAttention", "nn.RNN", "nn.LSTM", "nn.GRU", "nn.CTCLoss"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_IN_CI else [])
                                  for n in MODULES])
def test_module_db(name):
    info = MODULES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _check_module(info, torch.float32, DEFAULT_SAMPLES) > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(MODULES))
def test_module_db_every_sample(name, dtype):
    info = MODULES[name]
    if dtype not in info.dtypes:
        pytest.skip(f"{name} lists no {dtype} samples")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _check_module(info, dtype, EVERY_SAMPLE_CAP) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODULES))
def test_module_db_jit(name):
    info = MODULES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _check_module(info, torch.float32, 3, jit=True) > 0


ERROR_MODULES = [m.name for m in module_db if m.module_error_inputs_func is not None]


@pytest.mark.parametrize("name", ERROR_MODULES)
def test_module_db_error_inputs(name):
    info = MODULES[name]
    errors = info.module_error_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=False,
                                           training=True)
    for error in errors:
        sample = error.module_error_input
        args, kwargs = ((sample.forward_input.args, sample.forward_input.kwargs) if sample.forward_input
                        else ((), {}))
        with pytest.raises(error.error_type, match=error.error_regex):
            module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).to("jax")
            module(*tree_map(lambda x: _to(x, "jax"), args), **tree_map(lambda x: _to(x, "jax"), kwargs))
