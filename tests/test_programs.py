"""Small realistic torch programs run on torch CPU (the oracle) and on the jax device.

Each program is run as written on both devices, eagerly and (where a training
step or a pure function makes sense) under `t2j.jit`, and the results, dtypes and
shapes are compared. Random programs cannot match torch's bit stream, so they
compare against torch's documented behaviour: reproducibility under a seed,
support, and sample statistics with several standard errors of slack.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2jax as t2j

O = torch.optim


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(steps)]


def _assert_params_close(model, ref, atol=1e-5, rtol=1e-4):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.device.type == "jax" and p.dtype == q.dtype and p.shape == q.shape, name
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=atol, rtol=rtol, msg=name)


def _train(device, make_opt, data, jit=False, scheduler=None, clip=None, model=None):
    """Losses and the model after one optimizer step per batch of ``data``."""
    model = model if model is not None else _model().to(device)
    opt = make_opt(model.parameters())
    sched = scheduler(opt) if scheduler else None

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            clip(model.parameters())
        opt.step()
        return loss

    run = t2j.jit(step) if jit else step
    losses = []
    for x, y in data:
        loss = run(x.to(device), y.to(device))
        assert loss.device.type == device and loss.dtype == torch.float32 and loss.shape == ()
        losses.append(loss.item())
        if sched is not None:
            if isinstance(sched, O.lr_scheduler.ReduceLROnPlateau):
                sched.step(losses[-1])
            else:
                sched.step()
    return losses, model, opt, run


# -- optimizers -------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd_momentum_nesterov_wd": lambda p, **k: O.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, **k),
    "sgd_dampening": lambda p, **k: O.SGD(p, lr=0.05, momentum=0.5, dampening=0.3, **k),
    "adam": lambda p, **k: O.Adam(p, lr=1e-2, **k),
    "adam_wd_maximize": lambda p, **k: O.Adam(p, lr=1e-2, weight_decay=0.1, maximize=True, **k),
    "adamw_amsgrad": lambda p, **k: O.AdamW(p, lr=1e-2, amsgrad=True, weight_decay=0.1, **k),
    "rmsprop_centered": lambda p, **k: O.RMSprop(p, lr=1e-3, centered=True, momentum=0.5, weight_decay=0.01, **k),
    "adagrad": lambda p, **k: O.Adagrad(p, lr=1e-2, lr_decay=0.01, weight_decay=0.01, **k),
    "adadelta": lambda p, **k: O.Adadelta(p, lr=1.0, weight_decay=0.01, **k),
    "adamax": lambda p, **k: O.Adamax(p, lr=1e-2, weight_decay=0.01, **k),
    "nadam": lambda p, **k: O.NAdam(p, lr=1e-2, weight_decay=0.01, **k),
    "nadam_decoupled": lambda p, **k: O.NAdam(p, lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True, **k),
    "radam": lambda p, **k: O.RAdam(p, lr=1e-2, **k),
    "asgd": lambda p, **k: O.ASGD(p, lr=1e-2, t0=2, **k),
    "rprop": lambda p, **k: O.Rprop(p, lr=1e-2, **k),
    # its step computes with Python's min / max of `step.item()` (`traced_builtins`)
    "adafactor": lambda p, **k: O.Adafactor(p, lr=1e-2, weight_decay=0.01, **k),
    "adafactor_maximize": lambda p, **k: O.Adafactor(p, lr=1e-2, maximize=True, **k),
}

# jit variants of configurations close to another one's: the full run (`-m slow`) covers them
_SLOW_JIT = {"sgd_dampening", "adam_wd_maximize", "nadam_decoupled", "adagrad", "adamax", "adafactor_maximize"}


def _optimizer_params(slow_jit):
    """(name, jit) cases: every optimizer eagerly and jitted, the jitted ones in ``slow_jit`` marked slow."""
    return [pytest.param(n, False, id=f"{n}-eager") for n in OPTIMIZERS] + [
        pytest.param(n, True, id=f"{n}-jit", marks=[pytest.mark.slow] if slow_jit(n) else []) for n in OPTIMIZERS
    ]


def _check_optimizer(name, jit, steps, **flags):
    """Train on torch CPU and on the jax device with the same optimizer; compare losses and parameters."""
    make = lambda p: OPTIMIZERS[name](p, **flags)  # noqa: E731
    data = _data(steps)
    expected, ref, ref_opt, _ = _train("cpu", make, data)
    actual, model, opt, run = _train("jax", make, data, jit=jit)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    _assert_params_close(model, ref)
    return model, opt, run, ref, ref_opt


@pytest.mark.parametrize("name, jit", _optimizer_params(lambda n: n in _SLOW_JIT))
def test_optimizer_matches_torch(name, jit):
    model, opt, run, ref, ref_opt = _check_optimizer(name, jit, 5, foreach=False)
    # the optimizer state lives on the jax device with torch's dtypes and values
    for p, q in zip(model.parameters(), ref.parameters()):
        for key, value in ref_opt.state[q].items():
            mine = opt.state[p][key]
            if isinstance(value, torch.Tensor):
                assert mine.dtype == value.dtype and mine.shape == value.shape, key
                torch.testing.assert_close(mine.cpu(), value, atol=1e-5, rtol=1e-4, msg=key)
    if jit:
        assert run.stats["traces"] <= 2, t2j.explain_recompiles()


@pytest.mark.parametrize("name, jit", _optimizer_params(lambda n: n not in ("adam", "sgd_momentum_nesterov_wd")))
def test_optimizer_foreach_matches_torch(name, jit):
    # the _foreach_* list ops run as their per-tensor ops (torch2jax/ops/foreach.py)
    _check_optimizer(name, jit, 3, foreach=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("op", ["addcmul", "addcdiv"])
def test_foreach_pointwise_with_a_tensor_of_scalars(op, dtype):
    # torch reads a CPU tensor of scalars out into numbers (each element's op in its own opmath);
    # a jax one (a compiled optimizer's step sizes) is computed the same way, not in float16
    g = torch.Generator().manual_seed(0)
    xs, t1, t2 = ([torch.randn(300, generator=g).to(dtype) + k for _ in range(2)] for k in (0, 0, 3))
    scalars = torch.tensor([0.1, -1 / 3], dtype=torch.float64)
    want = getattr(torch, f"_foreach_{op}")(xs, t1, t2, scalars)
    on_jax = [[t.to("jax") for t in ts] for ts in (xs, t1, t2)]
    for where in ("cpu", "jax"):
        got = getattr(torch, f"_foreach_{op}")(*on_jax, scalars.to(where))
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b), where
    for bad, message in [(scalars[None], "of dimension 1. Got 2"), (scalars[:1], "input of length 2 but got 1"),
                         (torch.tensor([1j, 1j]), "cannot be converted to type")]:
        with pytest.raises(RuntimeError, match=message):
            getattr(torch, f"_foreach_{op}")(*on_jax, bad)


@pytest.mark.parametrize("make, cycle_betas", [
    (lambda p: torch.optim.Adam(p, lr=1e-2), False), (lambda p: torch.optim.AdamW(p, lr=1e-2), False),
    (lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True), False),
    (lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True), False), (lambda p: torch.optim.AdamW(p, lr=1e-2), True),
], ids=["adam", "adamw", "adam_amsgrad", "adamw_foreach", "adamw_cycling_betas"])
def test_warmup_from_zero_lr_with_untouched_rows(make, cycle_betas):
    """A linear warmup's first step has lr=0, and the embedding rows the batch does not
    use have zero second moments: torch's step leaves them as they are (no 0/0), also
    where the betas change between steps (program inputs)."""
    results = []
    for device in ("cpu", "jax"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3)).to(device)
        opt = make(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))
        ids = torch.tensor([[1, 2], [3, 1]]).to(device)

        def step(ids):
            opt.zero_grad()
            loss = model(ids).pow(2).sum()
            loss.backward()
            opt.step()
            return loss.detach()

        run = t2j.jit(step) if device == "jax" else step
        losses = []
        for k in range(4):
            losses.append(run(ids).cpu())
            sched.step()
            if cycle_betas:
                opt.param_groups[0]["betas"] = (0.9 - 0.01 * k, 0.999)
        results.append((torch.stack(losses), [p.detach().cpu() for p in model.parameters()]))
    (want, ref), (got, params) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, jit", [("adam", False), ("adamw_amsgrad", False), ("adam", True)])
def test_fused_adam_matches_torch(name, jit):
    # _fused_adam_ / _fused_adamw_ decomposed in torch2jax/ops/foreach.py
    _check_optimizer(name, jit, 3, fused=True)


@pytest.mark.parametrize("name, jit", [("sgd_momentum_nesterov_wd", False), ("adagrad", False), ("adagrad", True)])
def test_fused_sgd_and_adagrad_match_torch(name, jit):
    # _fused_sgd_ / _fused_adagrad_ decomposed in torch2jax/ops/foreach.py: no host fallback (its warning fails)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _check_optimizer(name, jit, 3, fused=True)


def test_default_optimizer_does_not_pick_foreach():
    # torch lists "jax" among the foreach devices, but the subclass is not a plain
    # tensor, so optimizers default to the per-tensor loop that works
    model = _model().to("jax")
    from torch.optim.optimizer import _default_to_fused_or_foreach

    assert _default_to_fused_or_foreach(list(model.parameters()), False, False) == (False, False)


def test_lbfgs_eager_matches_torch():
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randn(32, 1)

    def fit(device):
        torch.manual_seed(0)
        lin = nn.Linear(4, 1).to(device)
        opt = O.LBFGS(lin.parameters(), lr=0.5, max_iter=5, history_size=4, line_search_fn="strong_wolfe")
        xs, ys = x.to(device), y.to(device)

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(lin(xs), ys)
            loss.backward()
            return loss

        return [opt.step(closure).item() for _ in range(3)], lin

    expected, ref = fit("cpu")
    actual, lin = fit("jax")
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=1e-5, rtol=1e-4)
    _assert_params_close(lin, ref, atol=1e-4)


SCHEDULERS = {
    "step": lambda o: O.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "cosine": lambda o: O.lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=1e-3),
    "onecycle": lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6, cycle_momentum=False),
    "lambda": lambda o: O.lr_scheduler.LambdaLR(o, lambda epoch: 1.0 / (1 + epoch)),
    "plateau": lambda o: O.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0, threshold=0.5),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_scheduler_outside_jitted_step(name):
    make = lambda p: O.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    data = _data(6)
    expected, ref, ref_opt, _ = _train("cpu", make, data, scheduler=SCHEDULERS[name])
    actual, model, opt, run = _train("jax", make, data, jit=True, scheduler=SCHEDULERS[name])
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    _assert_params_close(model, ref)
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    # the learning rate changed between calls, yet the step was traced only for the
    # first call (no momentum buffers) and the second
    assert run.stats["traces"] == 2, t2j.explain_recompiles()


CYCLING = {
    "sgd_onecycle": (lambda p: O.SGD(p, lr=0.05, momentum=0.9),
                     lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6)),
    "sgd_nesterov_cyclic": (lambda p: O.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
                            lambda o: O.lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=2)),
    "adam_onecycle": (lambda p: O.Adam(p, lr=1e-2), lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6)),
    "adamw_foreach_onecycle": (lambda p: O.AdamW(p, lr=1e-2, foreach=True),
                               lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6)),
    "rmsprop_onecycle": (lambda p: O.RMSprop(p, lr=1e-3, momentum=0.5),
                         lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=6)),
    # fused groups: traced as foreach (the fused ops take betas / momentum as Python floats)
    "adam_fused_onecycle": (lambda p: O.Adam(p, lr=1e-2, fused=True),
                            lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6)),
    "sgd_fused_onecycle": (lambda p: O.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, fused=True),
                           lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6)),
}


@pytest.mark.parametrize("name", list(CYCLING))
def test_cycling_momentum_does_not_retrace(name):
    # OneCycleLR / CyclicLR rewrite param_group['momentum'] (or betas[0]) on every step:
    # the value becomes a program input from the first change, not a retrace per step
    make, sched = CYCLING[name]
    data = _data(6)
    expected, ref, ref_opt, _ = _train("cpu", make, data, scheduler=sched)
    actual, model, opt, run = _train("jax", make, data, jit=True, scheduler=sched)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    _assert_params_close(model, ref)
    assert opt.param_groups[0] == {**ref_opt.param_groups[0], "params": opt.param_groups[0]["params"]}
    # the first call (no optimizer state yet), the second (its momentum changed once)
    assert run.stats["traces"] == 2, t2j.explain_recompiles()


FUSED = {
    "sgd_momentum": lambda p: O.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, fused=True),
    "sgd_nesterov_maximize": lambda p: O.SGD(p, lr=0.05, momentum=0.9, nesterov=True, maximize=True, fused=True),
    "sgd_plain": lambda p: O.SGD(p, lr=0.05, fused=True),
    "adagrad": lambda p: O.Adagrad(p, lr=0.05, fused=True),
}


@pytest.mark.parametrize("name", list(FUSED))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_fused_optimizers_match_torch(name, jit):
    # fused SGD is lowered (it ran on the host); fused Adagrad is traced as foreach
    data = _data(4)
    expected, ref, *_ = _train("cpu", FUSED[name], data)
    actual, model, _, run = _train("jax", FUSED[name], data, jit=jit)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    _assert_params_close(model, ref)
    if jit:
        assert run.stats["traces"] == 2 and run.stats["eager_calls"] == 0, t2j.explain_recompiles()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float64_adam_keeps_float64_digits(jit):
    # the bias corrections in float64, as torch's kernels (1 - 0.999 in float32 is off by 1e-5)
    def run(device):
        w = torch.ones(3, dtype=torch.float64, device=device, requires_grad=True)
        opt = O.Adam([w], lr=0.1, fused=device == "jax" and not jit)

        def step():
            opt.zero_grad()
            (w * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, device=device)).sum().backward()
            opt.step()

        stepper = t2j.jit(step) if device == "jax" and jit else step
        for _ in range(3):
            stepper()
        return w.detach().cpu()

    torch.testing.assert_close(run("jax"), run("cpu"), atol=1e-14, rtol=1e-14)


class _Schedule:
    """A scheduler setting ``param_groups[0][key]`` to the next of ``values`` before each step."""

    def __init__(self, key, values):
        self.key, self.values = key, list(values)

    def __call__(self, opt):
        self.opt, self.left = opt, iter(self.values)
        self.step()
        return self

    def step(self):
        self.opt.param_groups[0][self.key] = next(self.left, None)


def test_hyperparameter_guard_retraces_when_a_branch_flips():
    # SGD branches on `weight_decay != 0`: once weight_decay is an input, the trace
    # made with 0.01 holds for 0.02 but not for 0.0, where torch skips the decay
    make = lambda p: O.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    sched = _Schedule("weight_decay", [0.0, 0.01, 0.02, 0.0, 0.03])
    data = _data(5)
    expected, ref, *_ = _train("cpu", make, data, scheduler=sched)
    before = len(t2j.explain_recompiles())
    actual, model, _, run = _train("jax", make, data, jit=True, scheduler=sched)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    _assert_params_close(model, ref)
    # first call; weight_decay lifted (0.01); 0.02 reuses it; 0.0 flips the branch;
    # 0.03 goes back to the program traced with a nonzero decay
    assert run.stats["traces"] == 3, t2j.explain_recompiles()
    assert any("goes the other way" in m for m in t2j.explain_recompiles()[before:])


class _FloatOnlySGD(O.Optimizer):
    """Plain SGD whose code insists on a Python float decay factor."""

    def __init__(self, params, lr=0.05, decay=1.0):
        super().__init__(params, dict(lr=lr, decay=decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            if not isinstance(group["decay"], float):
                raise TypeError("decay must be a float")
            for p in group["params"]:
                p.mul_(group["decay"]).add_(p.grad, alpha=-group["lr"])


def test_hyperparameter_that_must_stay_a_float_is_kept_static():
    sched = _Schedule("decay", [1.0, 0.99, 0.98, 0.99])
    data = _data(4)
    expected, *_ = _train("cpu", _FloatOnlySGD, data, scheduler=sched)
    before = len(t2j.explain_recompiles())
    actual, *_, run = _train("jax", _FloatOnlySGD, data, jit=True, scheduler=sched)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    # each new decay value retraces (0.99 comes back: cached), after one failed attempt to lift it
    assert run.stats["traces"] == 4, t2j.explain_recompiles()
    assert any("cannot be program inputs" in m for m in t2j.explain_recompiles()[before:])


def test_param_groups_with_different_lrs():
    def make(model):
        return lambda _: O.Adam(
            [
                {"params": model[0].parameters(), "lr": 1e-2},
                {"params": model[2].parameters(), "lr": 1e-3, "betas": (0.5, 0.9)},
            ]
        )

    data = _data(4)
    ref = _model()
    expected, *_ = _train("cpu", make(ref), data, model=ref)
    for jit in (False, True):
        model = _model().to("jax")
        actual, *_ = _train("jax", make(model), data, jit=jit, model=model)
        torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=2e-5, rtol=2e-4)
        _assert_params_close(model, ref)


CLIPS = {
    "norm": lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm=0.1),
    "norm_inf": lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm=0.05, norm_type=float("inf")),
    "value": lambda ps: torch.nn.utils.clip_grad_value_(ps, clip_value=0.01),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CLIPS))
def test_gradient_clipping(name, jit):
    make = lambda p: O.SGD(p, lr=0.5, foreach=False)  # noqa: E731
    clip = lambda ps: CLIPS[name](list(ps))  # noqa: E731
    data = _data(4)
    expected, ref, *_ = _train("cpu", make, data, clip=clip)
    actual, model, *_ = _train("jax", make, data, jit=jit, clip=clip)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    _assert_params_close(model, ref)


def test_clip_grad_norm_returns_total_norm():
    for device in ("cpu", "jax"):
        model = _model().to(device)
        F.cross_entropy(model(_data(1)[0][0].to(device)), _data(1)[0][1].to(device)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        if device == "cpu":
            expected = norm
        else:
            assert norm.device.type == "jax" and norm.dtype == expected.dtype
            torch.testing.assert_close(norm.cpu(), expected)
            clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            assert clipped.item() == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_zero_grad_set_to_none_false_accumulates(jit):
    def run(device):
        model = _model().to(device)
        opt = O.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, y, accumulate):
            if not accumulate:
                opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            if accumulate:
                opt.step()

        step = t2j.jit(step) if jit and device == "jax" else step
        for i, (x, y) in enumerate(_data(6)):
            step(x.to(device), y.to(device), i % 2 == 1)
        return model

    ref, model = run("cpu"), run("jax")
    _assert_params_close(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-4)
    opt = O.SGD(model.parameters(), lr=0.1)
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        assert p.grad is not None and p.grad.device.type == "jax" and not p.grad.any().item()


# -- optimizer checkpoints --------------------------------------------------------------


def _save_load(obj, **kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, **kwargs)


@pytest.mark.parametrize(
    "opt_name, jit",
    [
        ("adamw_amsgrad", False),
        ("adamw_amsgrad", True),
        ("sgd_momentum_nesterov_wd", False),
        pytest.param("sgd_momentum_nesterov_wd", True, marks=pytest.mark.slow),
        ("rmsprop_centered", False),
        pytest.param("rmsprop_centered", True, marks=pytest.mark.slow),
    ],
)
def test_optimizer_state_dict_roundtrip_mid_training(opt_name, jit):
    make = lambda p: OPTIMIZERS[opt_name](p, foreach=False)  # noqa: E731
    data = _data(6)
    expected, ref, *_ = _train("cpu", make, data)

    first, model, opt, _ = _train("jax", make, data[:3], jit=jit)
    ckpt = _save_load({"model": model.state_dict(), "optimizer": opt.state_dict()})
    for value in ckpt["model"].values():
        assert value.device.type == "jax"
    fresh = _model()
    with torch.no_grad():  # different weights, so only the checkpoint can make it match
        for p in fresh.parameters():
            p.mul_(0.5)
    fresh = fresh.to("jax")
    fresh.load_state_dict(ckpt["model"])

    def resumed(params):
        opt = make(params)
        opt.load_state_dict(ckpt["optimizer"])
        return opt

    rest, model2, opt2, _ = _train("jax", resumed, data[3:], jit=jit, model=fresh)
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    _assert_params_close(model2, ref)
    for p, state in opt2.state.items():
        for key, value in state.items():
            # eager torch keeps the step counter on the CPU unless capturable, as on CUDA
            if isinstance(value, torch.Tensor) and key != "step":
                assert value.device.type == "jax" and value.shape == p.shape, key


def test_jax_checkpoint_loads_on_cpu_with_map_location():
    make = lambda p: O.Adam(p, lr=1e-2)  # noqa: E731
    data = _data(5)
    expected, ref, *_ = _train("cpu", make, data)
    first, model, opt, _ = _train("jax", make, data[:2], jit=True)
    ckpt = _save_load({"model": model.state_dict(), "optimizer": opt.state_dict()}, map_location="cpu")
    for value in ckpt["model"].values():
        assert type(value) is torch.Tensor and value.device.type == "cpu"
    for state in ckpt["optimizer"]["state"].values():
        for value in state.values():
            assert type(value) is torch.Tensor and value.device.type == "cpu"
    cpu_model = _model()
    cpu_model.load_state_dict(ckpt["model"])

    def resumed(params):
        opt = make(params)
        opt.load_state_dict(ckpt["optimizer"])
        return opt

    rest, cpu_model, *_ = _train("cpu", resumed, data[2:], model=cpu_model)
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    for p, q in zip(cpu_model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("location", ["jax", "jax:0", {"cpu": "jax"}, torch.device("jax")], ids=str)
def test_cpu_checkpoint_loads_onto_the_jax_device(location):
    model = _model()
    state = dict(model.state_dict(), view=model.state_dict()["0.weight"][1:, ::2], big=torch.tensor([2**40, -3]))
    ckpt = _save_load(state, map_location=location)
    for name, value in ckpt.items():
        assert value.device.type == "jax", name
        assert value.dtype == state[name].dtype, name
        torch.testing.assert_close(value.cpu(), state[name])
    # tensors that shared a storage in the checkpoint share it on the jax device too
    ckpt["0.weight"].mul_(2)
    torch.testing.assert_close(ckpt["view"].cpu(), 2 * state["view"])


def test_cpu_training_checkpoint_resumes_on_the_jax_device():
    data = _data(4)
    make = lambda p: O.Adam(p, lr=1e-2)  # noqa: E731
    ref = _model()
    ref_opt = make(ref.parameters())
    expected = []
    for i, (x, y) in enumerate(data):
        if i == 2:
            saved = _save_load({"model": ref.state_dict(), "opt": ref_opt.state_dict()}, map_location="jax")
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        expected.append(loss.item())
    model = _model().to("jax")
    model.load_state_dict(saved["model"])
    opt = make(model.parameters())
    opt.load_state_dict(saved["opt"])
    assert all(v.device.type == "jax" for st in opt.state.values() for v in st.values())
    actual, *_ = _train("jax", lambda _: opt, data[2:], jit=True, model=model)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected[2:]), atol=2e-5, rtol=2e-4)


# -- random numbers -------------------------------------------------------------------


def _draws():
    draws = [torch.randn(3, device="jax"), torch.rand(2, device="jax"), torch.randint(0, 9, (2,), device="jax")]
    return torch.cat(draws)


def test_manual_seed_reproduces_eager_and_jit():
    f = t2j.jit(lambda x: x + torch.randn(4, device="jax") + torch.rand_like(x))
    x = torch.zeros(4, device="jax")
    torch.manual_seed(7)
    eager = _draws()
    torch.manual_seed(7)
    assert torch.equal(_draws().cpu(), eager.cpu())
    assert not torch.equal(_draws().cpu(), eager.cpu())
    torch.manual_seed(3)
    a, b = f(x).cpu(), f(x).cpu()
    torch.manual_seed(3)
    assert torch.equal(f(x).cpu(), a) and torch.equal(f(x).cpu(), b)
    assert not torch.equal(a, b)
    assert f.stats["traces"] == 1


def test_randperm_is_a_permutation_and_seeded():
    torch.manual_seed(0)
    p = torch.randperm(50, device="jax")
    assert p.dtype == torch.int64 and p.device.type == "jax"
    assert sorted(p.tolist()) == list(range(50))
    assert p.tolist() != list(range(50))
    torch.manual_seed(0)
    assert torch.equal(torch.randperm(50, device="jax").cpu(), p.cpu())
    assert torch.randperm(5, device="jax", dtype=torch.int32).dtype == torch.int32
    f = t2j.jit(lambda x: x[torch.randperm(x.shape[0], device="jax")])
    x = torch.arange(20.0, device="jax")
    shuffled = f(x)
    assert sorted(shuffled.tolist()) == x.tolist() and shuffled.tolist() != x.tolist()


def test_multinomial_with_and_without_replacement():
    torch.manual_seed(0)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 40_000
    draws = torch.multinomial(probs.to("jax"), n, replacement=True)
    assert draws.dtype == torch.int64 and draws.shape == (n,)
    freq = torch.bincount(draws.cpu(), minlength=4).double() / n
    torch.testing.assert_close(freq, probs.double(), atol=5 * math.sqrt(0.25 / n), rtol=0)
    batch = torch.tensor([[0.0, 1.0, 1.0, 0.0, 2.0], [5.0, 0.0, 0.0, 1.0, 0.0]])
    rows = torch.multinomial(batch.to("jax"), 3).cpu()
    assert rows.shape == (2, 3)
    for row, w in zip(rows.tolist(), batch):
        assert len(set(row[: int((w > 0).sum())])) == min(3, int((w > 0).sum()))
        assert all(w[i] > 0 for i in row[: int((w > 0).sum())])
    # without replacement the first pick follows probs; second picks follow the renormalized rest
    firsts = torch.multinomial(probs.to("jax").expand(n, 4), 2).cpu()
    assert (firsts[:, 0] != firsts[:, 1]).all()
    freq = torch.bincount(firsts[:, 0], minlength=4).double() / n
    torch.testing.assert_close(freq, probs.double(), atol=5 * math.sqrt(0.25 / n), rtol=0)
    p0 = probs.double()
    second = sum(p0[i] * p0[1] / (1 - p0[i]) for i in range(4) if i != 1)
    assert abs((firsts[:, 1] == 1).double().mean() - second) < 5 * math.sqrt(0.25 / n)


@pytest.mark.parametrize(
    "probs, message",
    [
        ([0.0, 0.0, 0.0], "sum of probabilities <= 0"),
        ([[1.0, 1.0], [0.0, 0.0]], "sum of probabilities <= 0"),
        ([-1.0, 2.0, 0.0], "element < 0"),
        ([float("nan"), 1.0], "element < 0"),
        ([float("inf"), 1.0], "element < 0"),
    ],
)
def test_multinomial_rejects_invalid_weights_like_torch(probs, message):
    for device in ("cpu", "jax"):
        with pytest.raises(RuntimeError, match=message):
            torch.multinomial(torch.tensor(probs, device=device), 1)


def test_generator_on_the_jax_device():
    g = torch.Generator(device="jax").manual_seed(1)
    assert g.device == torch.device("jax", 0) and isinstance(g, torch.Generator)
    assert isinstance(torch.default_generator, torch.Generator) and type(torch.Generator()) is torch._C.Generator

    def draws(gen):
        return torch.cat([torch.randn(3, device="jax", generator=gen), torch.rand(2, device="jax", generator=gen),
                          torch.randint(0, 9, (2,), device="jax", generator=gen).float(),
                          torch.randperm(4, device="jax", generator=gen).float(),
                          torch.empty(2, device="jax").uniform_(generator=gen)])

    first = draws(g)
    assert first.device.type == "jax"
    assert torch.equal(draws(torch.Generator("jax:0").manual_seed(1)).cpu(), first.cpu())
    assert not torch.equal(draws(g).cpu(), first.cpu())
    # its state round-trips like a CPU generator's, and the default stream is untouched
    state = g.get_state()
    torch.manual_seed(5)
    default = torch.randn(4, device="jax")
    a = draws(g)
    g.set_state(state)
    torch.manual_seed(5)
    torch.randn(3, device="jax", generator=torch.Generator(device="jax").manual_seed(9))
    assert torch.equal(torch.randn(4, device="jax").cpu(), default.cpu())
    assert torch.equal(draws(g).cpu(), a.cpu())
    g.set_state(state)
    assert torch.equal(draws(pickle.loads(pickle.dumps(g))).cpu(), a.cpu())


_INPLACE_DISTRIBUTIONS = {
    # name: (call, mean, variance or None, support check)
    "normal_": (lambda t: t.normal_(2.0, 3.0), 2.0, 9.0, None),
    "uniform_": (lambda t: t.uniform_(-1.0, 3.0), 1.0, 16 / 12, lambda v: (v >= -1).all() and (v < 3).all()),
    "exponential_": (lambda t: t.exponential_(2.0), 0.5, 0.25, lambda v: (v >= 0).all()),
    "geometric_": (
        lambda t: t.geometric_(0.25), 4.0, 0.75 / 0.0625, lambda v: (v >= 1).all() and (v == v.round()).all()
    ),
    "log_normal_": (
        lambda t: t.log_normal_(0.0, 0.5),
        math.exp(0.125),
        (math.exp(0.25) - 1) * math.exp(0.25),
        lambda v: (v > 0).all(),
    ),
    "cauchy_": (lambda t: t.cauchy_(1.0, 2.0), None, None, None),
}


@pytest.mark.parametrize("name", list(_INPLACE_DISTRIBUTIONS))
def test_inplace_distribution_on_a_view(name):
    call, mean, var, support = _INPLACE_DISTRIBUTIONS[name]
    torch.manual_seed(0)
    n = 20_000
    base = torch.full((3, n), -7.0, device="jax")
    view = base.view(n, 3).t()[1]  # a strided view: every third element
    out = call(view)
    assert out is view and view.shape == (n,) and view.dtype == torch.float32
    host = base.cpu().view(-1)
    expected_untouched = torch.ones(3 * n, dtype=torch.bool)
    expected_untouched[1::3] = False
    assert (host[expected_untouched] == -7.0).all()
    sample = host[1::3].double()
    torch.testing.assert_close(view.cpu().double(), sample)
    if support is not None:
        assert support(sample)
    if mean is None:  # cauchy: compare quartiles, its mean does not exist
        q = torch.quantile(sample, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
        torch.testing.assert_close(q, torch.tensor([-1.0, 1.0, 3.0], dtype=torch.float64), atol=0.15, rtol=0)
        return
    assert abs(sample.mean().item() - mean) < 6 * math.sqrt(var / n)
    assert abs(sample.var().item() - var) < 0.1 * var


def test_inplace_distribution_inside_jit_writes_the_view():
    @t2j.jit
    def f(x):
        x[:, 0].normal_()
        x[:, 1].uniform_(5, 6)
        return x.sum()

    x = torch.zeros(1000, 3, device="jax")
    torch.manual_seed(0)
    f(x)
    host = x.cpu()
    assert (host[:, 2] == 0).all() and (host[:, 1] >= 5).all() and (host[:, 1] < 6).all()
    assert abs(host[:, 0].mean()) < 0.2 and abs(host[:, 0].std() - 1) < 0.1
    before = host.clone()
    f(x)
    assert not torch.equal(x.cpu()[:, 0], before[:, 0])


def test_generator_objects():
    g1 = torch.Generator().manual_seed(5)
    g2 = torch.Generator().manual_seed(5)
    a = torch.randn(4, device="jax", generator=g1)
    torch.manual_seed(123)  # the global seed does not affect an explicit generator
    b = torch.randn(4, device="jax", generator=g2)
    assert torch.equal(a.cpu(), b.cpu())
    assert not torch.equal(torch.randn(4, device="jax", generator=g1).cpu(), a.cpu())
    x = torch.empty(1000, device="jax")
    x.uniform_(0, 1, generator=g1)
    assert (x.cpu() >= 0).all() and (x.cpu() < 1).all()
    torch.manual_seed(0)
    p = torch.randperm(10, device="jax", generator=torch.Generator().manual_seed(1))
    q = torch.randperm(10, device="jax", generator=torch.Generator().manual_seed(1))
    assert torch.equal(p.cpu(), q.cpu())


def test_get_set_rng_state_and_fork_rng():
    torch.manual_seed(0)
    state = torch.jax.get_rng_state()
    a = _draws()
    torch.jax.set_rng_state(state)
    assert torch.equal(_draws().cpu(), a.cpu())
    # fork_rng restores the jax device's stream on exit
    torch.jax.set_rng_state(state)
    with torch.random.fork_rng(device_type="jax"):
        torch.manual_seed(99)
        inside = _draws()
    assert torch.equal(_draws().cpu(), a.cpu())
    assert not torch.equal(inside.cpu(), a.cpu())
    # the CPU generator's own state functions are untouched by the jax stream
    cpu_state = torch.get_rng_state()
    _draws()
    assert torch.equal(torch.get_rng_state(), cpu_state)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_dropout_train_vs_eval(jit):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4000), nn.Dropout(0.3)).to("jax")
    run = t2j.jit(lambda x: model(x)) if jit else model
    x = torch.ones(2, 4, device="jax")
    model.eval()
    dense = run(x).cpu()
    model.train()
    a, b = run(x).cpu(), run(x).cpu()
    kept = a != 0
    keep_rate = kept.double().mean().item()
    assert abs(keep_rate - 0.7) < 6 * math.sqrt(0.21 / kept.numel())
    torch.testing.assert_close(a[kept], dense[kept] / 0.7)
    assert not torch.equal(a, b)
    model.eval()
    torch.testing.assert_close(run(x).cpu(), dense)


# -- views and in-place ops ----------------------------------------------------------------


def _p_view_chain(x, y):
    x.view(2, 3, 4).transpose(0, 1)[1].mul_(2)
    return x.view(6, 4).sum(0)


def _p_unfold(x, y):
    w = x[:10].unfold(0, 4, 3)  # overlapping windows of a view
    w[:, 0].add_(100)
    return w.clone()


def _p_as_strided(x, y):
    x.as_strided((3, 3), (4, 1), 2).add_(y[:9].view(3, 3))
    return x.as_strided((4,), (5,)).clone()


def _p_diagonal_fill(x, y):
    m = x.view(4, 6)
    m.diagonal().fill_(-1)
    m.diagonal(offset=2).zero_()
    return m.t().diagonal().clone()


def _p_strided_setitem(x, y):
    m = x.view(2, 3, 4)
    m[..., ::2] = y[:12].view(2, 3, 2)
    m[:, 1:, 1] = 0.5
    return m.clone()


def _p_masked_fill(x, y):
    x.view(4, 6)[:, 1:4].masked_fill_(y.view(4, 6)[:, :3] > 0, -3.0)
    return (x > 0).sum()


def _p_scatter_index_add(x, y):
    m = x.view(4, 6)
    idx = torch.tensor([[0, 1, 2], [3, 2, 1]], device=x.device)
    m.t()[:2].scatter_(1, idx, y[:6].view(2, 3))
    m.index_add_(0, torch.tensor([0, 2, 0], device=x.device), y[:18].view(3, 6), alpha=0.5)
    return m.clone()


def _p_copy_between_dtypes(x, y):
    i = torch.zeros(24, dtype=torch.int32, device=x.device)
    i.view(4, 6)[1:3].copy_(y.view(4, 6)[1:3] * 10)  # float -> int truncates
    h = torch.zeros(4, 6, dtype=torch.float16, device=x.device)
    h[::2].copy_(x.view(4, 6)[::2])
    b = torch.zeros(24, dtype=torch.bool, device=x.device)
    b.copy_(y > 0)
    return i, h, b


def _p_out_arguments(x, y):
    out = torch.empty(24, device=x.device)
    torch.add(x, y, alpha=2, out=out)
    torch.mul(x.view(4, 6)[:2], 3, out=x.view(4, 6)[2:])  # out= into a view of x
    s = torch.empty((), device=x.device)
    torch.sum(y, dim=0, out=s)
    return out, s


def _p_data_mutation(x, y):
    p = x.view(4, 6).clone().requires_grad_()
    loss = (p * p).sum()
    p.data.mul_(0.5)  # .data writes without autograd noticing
    p.data[0] = 1.0
    loss.backward()
    return p.detach().clone(), p.grad


def _p_detach_shares_storage(x, y):
    d = x.detach()
    d[3:7] = 9.0
    v = x.view(4, 6).detach()[1]
    v.add_(1)
    return d.clone()


def _p_leaf_inplace_under_no_grad(x, y):
    w = y.view(4, 6).clone().requires_grad_()
    with torch.no_grad():
        w[0].mul_(2)
        w.add_(x.view(4, 6))
    loss = (w**2).sum()
    loss.backward()
    return w.detach().clone(), w.grad, w.requires_grad


def _p_chunk_split_select(x, y):
    a, b = x.view(4, 6).chunk(2, dim=1)
    a.select(0, 2).sub_(1)
    b.narrow(0, 1, 2).mul_(y[:3].view(1, 3))
    for piece in x.split(5):
        piece[-1] = piece.sum()
    return x.clone()


def _p_int_and_complex_views(x, y):
    i = torch.arange(24, device=x.device)
    i.view(4, 6)[:, ::3] //= 2
    i.view(2, 12).t()[3:5].neg_()
    c = torch.complex(x, y)
    c.imag.mul_(-1)
    c.view(4, 6)[0].real.add_(1)
    return i, c


def _p_duplicate_index_put(x, y):
    i = torch.tensor([0, 2, 0], device=x.device)
    x[i] += 1.0  # duplicates: the last write wins, as on torch CPU
    x.index_put_((i,), y[:3], accumulate=True)
    return x.clone()


def _p_dtype_view_write(x, y):
    bits = x.view(torch.int32)
    bits[0] = 0
    bits[1:3] &= 0x7FFFFF00
    return bits.clone()


def _p_inplace_metadata_ops(x, y):
    z = x.view(4, 6)[:1].clone()
    z.squeeze_(0)
    z.unsqueeze_(1)
    z.t_()
    z.mul_(2)
    return z, z.stride(), z.shape


def _p_noncontiguous_copy_and_metadata(x, y):
    m = x.view(4, 6)
    m[:, :4].copy_(y.view(6, 4)[:4].t().t())
    v = m.t()[1:, 2:]
    return v.stride(), v.storage_offset(), v.is_contiguous(), v.contiguous().stride()


def _p_addcmul_clamp_lerp(x, y):
    m = x.view(4, 6)
    m[1:].addcmul_(y.view(4, 6)[1:], y.view(4, 6)[:3], value=2)
    m.t()[::2].clamp_(min=-0.5, max=0.5)
    m[1:3].lerp_(y.view(4, 6)[1:3], 0.3)
    m.fill_diagonal_(5.0)
    m.tril_(2)
    return m.clone()


def _p_index_and_mask_setitem(x, y):
    x.view(-1)[torch.tensor([1, 5, 7], device=x.device)] = y[:3]
    x.view(4, 6)[torch.tensor([True, False, True, False], device=x.device)] = 2.0
    x[x < -1] = 0.0
    return x.clone()


def _p_assign_data(x, y):
    w = nn.Parameter(x.view(4, 6).clone())
    w.data = y.view(6, 4)
    (w * 2).sum().backward()
    return w.detach().clone(), w.grad, w.shape


def _p_out_aliasing_inputs(x, y):
    torch.cumsum(x, 0, out=y)
    torch.where(x > 0, x, y, out=x)
    return x.clone()


def _p_expand_split_unbind(x, y):
    e = x[:4].expand(3, 4)
    c = e.clone()
    c[0].add_(1)
    for k, piece in enumerate(torch.split(x, [5, 7, 12])):
        piece.mul_(k + 1)
    a, b = x.view(4, 6).unbind(1)[:2]
    a.copy_(b)
    return c, e.stride()


def _p_integer_inplace(x, y):
    i = (y * 10).long()
    i.view(4, 6)[::2].div_(3, rounding_mode="floor")
    i.remainder_(7)
    i[3:9].bitwise_xor_(5)
    i.view(2, 12).t()[1::3].pow_(2)
    return i


def _p_half_precision_inplace(x, y):
    h = x.half()
    h.view(4, 6)[1].mul_(1000)
    h.add_(y.half())
    b = x.bfloat16()
    b[::3].exp_()
    return h, b


def _p_write_through_detach_of_a_result(x, y):
    a = x.clone().requires_grad_()
    b = a * 2
    b.detach()[0] = 100.0
    b.sum().backward()
    return b.detach().clone(), a.grad


VIEW_PROGRAMS = {name[3:]: fn for name, fn in dict(globals()).items() if name.startswith("_p_")}


def test_boolean_mask_read_modify_write_under_jit_raises_a_clear_error():
    # x[mask] *= 2 reads x[mask] first, whose shape depends on the mask's values
    f = t2j.jit(lambda x: x.view(4, 6)[x.view(4, 6)[:, 0] > 0].mul_(2), fullgraph=True)
    with pytest.raises(RuntimeError, match="depends on tensor values"):
        f(torch.ones(24, device="jax"))
    # a constant mask's values are known to the trace: the program has a static gather
    g = t2j.jit(lambda x: x.view(4, 6)[torch.tensor([True, False, True, False], device=x.device)].mul_(2),
                fullgraph=True)
    torch.testing.assert_close(g(torch.arange(24.0, device="jax")).cpu(), torch.arange(24.0).view(4, 6)[::2] * 2)


def _view_inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(24, generator=gen), torch.randn(24, generator=gen)


def _compare(actual, expected, what):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.device.type == "jax", what
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual.dtype, expected.dtype)
        torch.testing.assert_close(actual.cpu(), expected, msg=what, atol=1e-5, rtol=1e-5, equal_nan=True)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), what
        for k, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, f"{what}[{k}]")
    else:
        assert actual == expected, what


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(VIEW_PROGRAMS))
def test_view_program_matches_torch(name, jit):
    program = VIEW_PROGRAMS[name]
    x, y = _view_inputs()
    expected = program(x, y)
    jx, jy = (t.to("jax") for t in _view_inputs())
    run = t2j.jit(program) if jit else program
    actual = run(jx, jy)
    _compare(actual, expected, "result")
    _compare((jx, jy), (x, y), "mutated inputs")


# -- AMP: GradScaler ----------------------------------------------------------------------


def _scaled_training(device, jit=False, steps=7, autocast=False, unscale_inside=False, step_inside=False,
                     optimizer="sgd", init_scale=None):
    """SGD (or Adam) with a GradScaler whose scale overflows at times: the scaler must skip
    those steps, back off, and grow every ``growth_interval`` clean steps. Under ``jit`` the
    forward and the scaled backward are jitted; the scaler's host-side bookkeeping
    (unscale_, step, update) runs outside unless ``unscale_inside``, and the whole step
    (clipping, scaler.step and scaler.update too) inside with ``step_inside``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    if optimizer == "sgd":
        opt = O.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    else:
        opt = O.Adam(model.parameters(), lr=1e-3)
    init = init_scale or (2.0**14 if autocast else 2.0**120)  # overflows float16 / float32 gradients at times
    scaler = torch.amp.GradScaler(device, init_scale=init, growth_interval=2)
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(16, 4, generator=gen) * 30).to(device) for _ in range(steps)]

    def forward_backward(x):
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16, enabled=autocast):
            out = model(x)
        loss = out.float().pow(2).mean()
        scaler.scale(loss).backward()
        if unscale_inside or step_inside:
            scaler.unscale_(opt)
        if not step_inside:
            return loss
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
        scaler.step(opt)
        scaler.update()
        return loss, norm

    run = t2j.jit(forward_backward) if jit else forward_backward
    trace = []
    for x in data:
        if step_inside:
            loss, norm = run(x)
        else:
            loss = run(x)
            if not unscale_inside:
                scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
            scaler.step(opt)
            scaler.update()
        trace.append((loss.item(), norm.item(), scaler.get_scale(), int(scaler._growth_tracker.item())))
    return trace, model


def _assert_scaler_traces_close(actual, expected):
    assert [t[2:] for t in actual] == [t[2:] for t in expected]  # scales and growth trackers exactly
    mine, torchs = torch.tensor([t[:2] for t in actual]), torch.tensor([t[:2] for t in expected])
    # an overflowed gradient's norm is inf or NaN depending on the order inf - inf meets it
    finite = torch.isfinite(torchs)
    assert torch.equal(finite, torch.isfinite(mine)), (mine, torchs)
    torch.testing.assert_close(mine[finite], torchs[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_scaler_matches_torch_cpu(jit):
    expected, ref = _scaled_training("cpu")
    actual, model = _scaled_training("jax", jit=jit)
    scales = [s for _, _, s, _ in expected]
    pairs = list(zip(scales, scales[1:]))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs), "skips a step and grows"
    _assert_scaler_traces_close(actual, expected)
    _assert_params_close(model, ref)


def test_grad_scaler_float16_autocast_tracks_torch_cpu():
    expected, ref = _scaled_training("cpu", autocast=True)
    actual, model = _scaled_training("jax", autocast=True)
    assert [t[2:] for t in actual] == [t[2:] for t in expected]
    losses = torch.tensor([t[0] for t in actual]), torch.tensor([t[0] for t in expected])
    torch.testing.assert_close(*losses, rtol=5e-3, atol=5e-3)
    _assert_params_close(model, ref, atol=2e-3, rtol=2e-3)


def test_grad_scaler_ops_match_torch_cpu():
    grads = [torch.tensor([1.0, 2.0, 4.0]), torch.tensor([[0.5, -8.0]], dtype=torch.float16)]
    for bad in (None, float("inf"), float("nan")):
        cpu = [g.clone() for g in grads]
        if bad is not None:
            cpu[1][0, 0] = bad
        jax_grads = [g.to("jax") for g in cpu]
        found, jfound = torch.zeros(1), torch.zeros(1, device="jax")
        inv = torch.full((1,), 0.25)
        torch._amp_foreach_non_finite_check_and_unscale_(cpu, found, inv)
        torch._amp_foreach_non_finite_check_and_unscale_(jax_grads, jfound, inv.to("jax"))
        _compare(jax_grads, cpu, f"grads ({bad})")
        _compare(jfound, found, f"found_inf ({bad})")
        for tracker in (0, 2):
            scale, grow = torch.full((), 8.0), torch.full((), tracker, dtype=torch.int32)
            jscale, jgrow = scale.to("jax"), grow.to("jax")
            torch._amp_update_scale_(scale, grow, found, 2.0, 0.5, 3)
            out = torch._amp_update_scale_(jscale, jgrow, jfound, 2.0, 0.5, 3)
            assert out is jscale
            _compare((jscale, jgrow), (scale, grow), f"update ({bad}, {tracker})")


def test_grad_scaler_unscale_inside_jit_is_refused():
    # a cached call would not repeat the scaler's Python bookkeeping: scaler.step outside
    # would unscale the gradients a second time, so the trace is refused with what to do
    with pytest.raises(t2j.JitError, match=r"GradScaler.*scaler.unscale_, scaler.step and scaler.update outside"):
        _scaled_training("jax", jit=True, unscale_inside=True)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_grad_scaler_step_inside_jit(optimizer):
    # the whole AMP step in one program: a step whose gradients overflowed leaves the
    # parameters and the optimizer state as they were (Adam's first step is skipped, so
    # its moments and step counter start from their initial values), as torch's host-side skip does
    expected, ref = _scaled_training("cpu", step_inside=True, optimizer=optimizer, init_scale=2.0**126)
    actual, model = _scaled_training("jax", jit=True, step_inside=True, optimizer=optimizer, init_scale=2.0**126)
    scales = [2.0**126] + [s for _, _, s, _ in expected]
    assert scales[1] < scales[0], "the first step overflows and is skipped"
    assert any(b > a for a, b in zip(scales, scales[1:])), "and later steps run"
    _assert_scaler_traces_close(actual, expected)
    _assert_params_close(model, ref)


def test_grad_scaler_skipped_first_steps_leave_no_optimizer_state():
    # torch makes SGD's momentum buffer from the gradient of the first step that is not skipped
    # (with dampening, not what a zero buffer gives): a jitted step whose steps so far were all
    # skipped has no optimizer state either
    torch.manual_seed(0)
    base = nn.Linear(4, 2)

    def run(device, jit):
        model = copy.deepcopy(base).to(device)
        opt = O.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
        scaler = torch.amp.GradScaler(device, init_scale=3e38, backoff_factor=1e-30)

        def step(x):
            scaler.scale(model(x).pow(2).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

        run_step, states = t2j.jit(step, fullgraph=True) if jit else step, []
        for i in range(4):
            run_step(torch.full((3, 4), i + 1.0, device=device))
            states.append(sorted(k for st in opt.state.values() for k in st))
        return model, states

    (ref, expected), (model, actual) = run("cpu", False), run("jax", True)
    assert actual == expected and expected[0] == [] and expected[1] == ["momentum_buffer"] * 2
    _assert_params_close(model, ref)


# -- save / load ------------------------------------------------------------------------


def test_torch_save_load_tensors_keeps_dtype_shape_and_values():
    values = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i32": torch.arange(-3, 3, dtype=torch.int32),
        "bool": torch.tensor([True, False]),
        "c64": torch.randn(3, dtype=torch.complex64),
        "scalar": torch.tensor(2.5),
    }
    loaded = _save_load({k: v.to("jax") for k, v in values.items()})
    for k, v in values.items():
        _compare(loaded[k], v, k)
    p = nn.Parameter(torch.randn(2, 3).to("jax"))
    q = _save_load(p)
    assert q.requires_grad and q.device.type == "jax"
    torch.testing.assert_close(q.detach().cpu(), p.detach().cpu())


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.complex128])
def test_torch_save_load_keeps_64_bit_dtypes(dtype):
    t = torch.arange(-3, 3).to(dtype)
    _compare(_save_load(t.to("jax")), t, "torch.load")
    _compare(pickle.loads(pickle.dumps(t.to("jax"))), t, "pickle")


def test_torch_save_load_view_values():
    x = torch.arange(24.0)
    jx = x.to("jax")
    views = {"t": x.view(4, 6).t(), "row": x.view(4, 6)[1], "strided": x[::5], "diag": x.view(4, 6).diagonal()}
    loaded = _save_load({k: f(jx) for k, f in {
        "t": lambda t: t.view(4, 6).t(),
        "row": lambda t: t.view(4, 6)[1],
        "strided": lambda t: t[::5],
        "diag": lambda t: t.view(4, 6).diagonal(),
    }.items()})
    for k, v in views.items():
        _compare(loaded[k], v, k)


def test_torch_save_load_preserves_storage_sharing():
    x = torch.arange(12.0, device="jax")
    loaded = _save_load({"x": x, "row": x.view(3, 4)[1]})
    loaded["x"].add_(1)
    assert loaded["row"].tolist() == [5.0, 6.0, 7.0, 8.0]


@pytest.mark.parametrize("kwargs", [{}, {"weights_only": True}, {"map_location": "cpu"}])
def test_torch_legacy_format_loads_values_and_sharing(kwargs):
    x = torch.arange(4.0, device="jax")
    buf = io.BytesIO()
    torch.save({"x": x, "tail": x[1:], "n": torch.arange(3, device="jax")}, buf,
               _use_new_zipfile_serialization=False)
    buf.seek(0)
    loaded = torch.load(buf, **kwargs)
    assert loaded["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and loaded["n"].tolist() == [0, 1, 2]
    assert loaded["x"].device.type == kwargs.get("map_location", "jax")
    loaded["x"][1] = 9.0
    assert loaded["tail"].tolist() == [9.0, 2.0, 3.0]


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_torch_save_load_of_dtype_views_like_torch(device):
    x = torch.arange(4.0, device=device)
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        torch.save({"x": x, "bits": x.view(torch.int32)}, io.BytesIO())
    z = torch.tensor([1 + 2j, 3 - 4j], device=device)
    loaded = _save_load({"bits": x.view(torch.int32), "tail": x[1:].view(torch.int32), "re": torch.view_as_real(z)})
    loaded["bits"][1] = 5  # the two int32 views still share their storage
    assert loaded["tail"].tolist() == [5, 1073741824, 1077936128] and loaded["tail"].device == x.device
    assert loaded["re"].tolist() == [[1.0, 2.0], [3.0, -4.0]] and loaded["re"].stride() == (2, 1)


def test_pickle_and_deepcopy_of_a_jax_model_train_like_the_original():
    model = _model().to("jax")
    opt = O.Adam(model.parameters(), lr=1e-2)
    _train("jax", lambda p: opt, _data(2), model=model)
    copies = {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model))}
    data = _data(3, seed=5)
    ref = copy.deepcopy(model)
    expected, ref, *_ = _train("jax", lambda p: O.SGD(p, lr=0.1), data, model=ref)
    for how, clone in copies.items():
        for p, q in zip(clone.parameters(), model.parameters()):
            assert p is not q and p.device.type == "jax" and p.requires_grad, how
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu())
        actual, clone, *_ = _train("jax", lambda p: O.SGD(p, lr=0.1), data, model=clone)
        assert actual == expected, how
    # the original was not touched by training its copies
    for p, q in zip(model.parameters(), copies["deepcopy"].parameters()):
        assert not torch.equal(p.detach().cpu(), q.detach().cpu())


def test_pickled_module_parameters_stay_parameters():
    clone = pickle.loads(pickle.dumps(_model().to("jax")))
    assert all(isinstance(p, nn.Parameter) for p in clone.parameters())


def test_deepcopy_keeps_tied_weights_tied():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    clone = copy.deepcopy(model.to("jax"))
    assert clone[1].weight is clone[0].weight
    assert clone[0].weight is not model[0].weight


def test_t2j_save_load_resumes_training(tmp_path):
    make = lambda p: O.AdamW(p, lr=1e-2, amsgrad=True, foreach=False)  # noqa: E731
    data = _data(5)
    expected, ref, *_ = _train("cpu", make, data)
    first, model, opt, _ = _train("jax", make, data[:2], jit=True)
    t2j.save({"model": model, "optimizer": opt, "step": 2, "note": "mid"}, str(tmp_path / "ckpt"))
    fresh = _model().to("jax")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = make(fresh.parameters())
    state = t2j.load(str(tmp_path / "ckpt"), {"model": fresh, "optimizer": fresh_opt})
    assert state["step"] == 2 and state["note"] == "mid"
    rest, fresh, *_ = _train("jax", lambda p: fresh_opt, data[2:], jit=True, model=fresh)
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(expected), atol=2e-5, rtol=2e-4)
    _assert_params_close(fresh, ref)


def test_state_dict_load_into_fresh_model_does_not_alias():
    model = _model().to("jax")
    fresh = _model().to("jax")
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        fresh[0].weight.add_(1)
    assert not torch.equal(fresh[0].weight.cpu(), model[0].weight.cpu())
    sd = model.state_dict()
    with torch.no_grad():
        model[0].bias.zero_()
    # state_dict() tensors alias the parameters, as in torch
    assert not sd["0.bias"].any().item()


def test_t2j_save_load_keeps_dtypes_views_and_python_values(tmp_path):
    x = torch.arange(12.0)
    values = {
        "bf16": torch.randn(3).to(torch.bfloat16),
        "i64": torch.arange(-2, 3),
        "f64": torch.randn(2, dtype=torch.float64),
        "bool": torch.tensor([True, False, True]),
    }
    state = {k: v.to("jax") for k, v in values.items()}
    state.update(view=x.to("jax").view(3, 4).t(), nested=[torch.ones(1).to("jax"), 3, "s"])
    t2j.save(state, str(tmp_path / "c"))
    out = t2j.load(str(tmp_path / "c"))
    for k, v in values.items():
        _compare(out[k], v, k)
    _compare(out["view"], x.view(3, 4).t(), "view")
    assert out["nested"][1:] == [3, "s"]
    _compare(out["nested"][0], torch.ones(1), "nested")
