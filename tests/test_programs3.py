"""Research-code torch programs, run on torch CPU (the oracle) and on the jax device.

The same harness as tests/test_programs2.py: each program is a function of ``(device, wrap)``
that builds its model and data on ``device`` from fixed seeds (weights are drawn on the CPU
and moved, so both devices start from the same numbers) and returns a tree of results.
``wrap`` is ``t2j.jit`` for the jitted variant on the jax device and the identity otherwise;
a program applies it to the function a user would compile (a train step or a pure function).
Randomness drawn on the device differs between devices (as CUDA's differs from the CPU's),
so programs that sample compare what must hold on every device: reproducibility under a
seed, shapes, supports and statistics.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch2jax  # noqa: F401 - registers the "jax" device
from programs_util import _batches, _compare, _gen, _grads, _ident, _mlp, _params, _randn, _train_step, _ce, run_program  # noqa: F401

O = torch.optim



# -- custom autograd.Function ---------------------------------------------------------------


class _ScaleInPlace(torch.autograd.Function):
    """Scales its input in place (mark_dirty) and also returns the argmax, which has no gradient."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        x.mul_(scale)
        idx = x.argmax(-1)
        ctx.mark_dirty(x)
        ctx.mark_non_differentiable(idx)
        return x, idx

    @staticmethod
    def backward(ctx, g, g_idx):
        return g * ctx.scale, None


class _SoftplusWithSaved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta):
        out = F.softplus(x, beta)
        ctx.save_for_backward(x, out)
        ctx.beta = beta
        return out

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        return g * torch.sigmoid(ctx.beta * x), None


def _p_custom_function_mark_dirty(device, wrap):
    model = _mlp(device)
    opt = O.SGD(model.parameters(), lr=0.2)

    def step(x, y):
        opt.zero_grad()
        h = model[0](x) + 0.0  # a non-leaf that the Function may modify in place
        h, idx = _ScaleInPlace.apply(h, 0.5)
        out = model[2](_SoftplusWithSaved.apply(h, 2.0))
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        return loss, idx, h.detach()

    step = wrap(step)
    return [step(x, y) for x, y in _batches(3, device)], _params(model)


class _TwoOutputs(torch.autograd.Function):
    """Two outputs of which the program uses one: with materialize_grads off the other's grad is None."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(a, b)
        return a * b, a + b

    @staticmethod
    def backward(ctx, g_prod, g_sum):
        a, b = ctx.saved_tensors
        ga = gb = None
        if g_prod is not None:
            ga, gb = g_prod * b, g_prod * a
        if g_sum is not None:
            ga = g_sum if ga is None else ga + g_sum
            gb = g_sum if gb is None else gb + g_sum
        return (ga if ctx.needs_input_grad[0] else None), (gb if ctx.needs_input_grad[1] else None)


class _Square(torch.autograd.Function):
    """A backward written in differentiable torch ops supports double backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def _p_custom_function_materialize_and_double_backward(device, wrap):
    a = _randn(5, device=device).requires_grad_()
    b = _randn(5, seed=1, device=device)  # no grad: needs_input_grad[1] is False
    prod, _ = _TwoOutputs.apply(a, b)
    prod.sum().backward()
    ga_prod = a.grad.clone()
    a.grad = None
    _, s = _TwoOutputs.apply(a, b)
    (s * s).sum().backward()
    x = _randn(4, seed=2, device=device).requires_grad_()
    (g,) = torch.autograd.grad(_Square.apply(x).sin().sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    return ga_prod, a.grad, g.detach(), gg, b.grad is None


# -- torch.func over jax-device modules ----------------------------------------------------


def _p_func_model_ensembling(device, wrap):
    from torch.func import functional_call, stack_module_state, vmap

    models = [_mlp(device, seed=s) for s in range(4)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = _batches(1, device)[0][0]

    def one(p, b, x):
        return functional_call(base, (p, b), (x,))

    same_x = vmap(one, in_dims=(0, 0, None))(params, buffers, x)
    per_x = vmap(one)(params, buffers, x[None].expand(4, -1, -1) * torch.arange(1.0, 5.0, device=device)[:, None,
                                                                                                         None])
    return same_x, per_x, torch.stack([m(x) for m in models]), {k: v.shape for k, v in params.items()}


def _p_func_per_sample_grad_clipping_dp_sgd(device, wrap):
    from torch.func import functional_call, grad, vmap

    model = _mlp(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    clip = 0.5

    def loss_one(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    def step(params, x, y, noise):
        g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([v.flatten(1).norm(dim=1) for v in g.values()]).norm(dim=0)
        factor = (clip / (norms + 1e-6)).clamp(max=1.0)
        new = {}
        for k, v in g.items():
            clipped = (v * factor.view(-1, *[1] * (v.dim() - 1))).sum(0)
            new[k] = params[k] - 0.1 * (clipped + noise[k]) / x.shape[0]
        return new, norms

    step = wrap(step)
    noise = {k: _randn(*v.shape, seed=i, device=device) * 0.01 for i, (k, v) in enumerate(params.items())}
    norms = []
    for x, y in _batches(3, device):
        params, n = step(params, x, y, noise)
        norms.append(n)
    return params, norms


def _p_func_jacrev_params_with_buffers(device, wrap):
    from torch.func import functional_call, grad_and_value, jacfwd, jacrev

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).to(device).eval()
    model[1].running_mean.fill_(0.3)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    x = _randn(5, 3, device=device)

    def f(p, x):
        return functional_call(model, (p, buffers), (x,))

    jac = jacrev(f)({k: v.detach() for k, v in params.items()}, x)
    jx = jacfwd(lambda x: f(params, x).sum(0))(x)

    def loss(p):
        out = f(p, x)
        return out.pow(2).mean(), out

    g, (value, out) = grad_and_value(loss, has_aux=True)({k: v.detach() for k, v in params.items()})
    return jac, jx.detach(), g, value, out.detach()


def _p_forward_mode_ad_dual_numbers(device, wrap):
    import torch.autograd.forward_ad as fwAD

    model = _mlp(device)
    x = _batches(1, device)[0][0]
    tangent = _randn(*x.shape, seed=4, device=device)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        out = model(dual)
        primal, jvp = fwAD.unpack_dual(out)
        primal, jvp = primal.detach().clone(), jvp.clone()
    v = _randn(6, seed=5, device=device)
    _, hvp = torch.autograd.functional.hvp(lambda z: (z.sin() * z).sum(), x[0], v)
    _, vjp = torch.autograd.functional.vjp(lambda z: model(z), x, torch.ones(8, 3, device=device))
    return primal, jvp, hvp, vjp


# -- hooks ----------------------------------------------------------------------------------


def _p_hooks_retain_grad_and_removal(device, wrap):
    model = _mlp(device)
    seen = []
    kw_seen = {}
    h_pre = model[2].register_full_backward_pre_hook(lambda m, go: (go[0] * 3.0,))
    h_fwd = model[1].register_forward_hook(lambda m, args, kwargs, out: kw_seen.update(n=len(kwargs)),
                                           with_kwargs=True)
    h_act = model[1].register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    x, y = _batches(1, device)[0]
    hidden = model[0](x)
    hidden.retain_grad()
    act = model[1](hidden)
    act.register_hook(lambda g: g * 0.5)
    out = model[2](act)
    out.retain_grad()
    F.cross_entropy(out, y).backward()
    first = (hidden.grad.clone(), out.grad.clone(), _grads(model))
    for h in (h_pre, h_fwd, h_act):
        h.remove()
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return first, _grads(model), len(seen), seen[0], kw_seen["n"], hidden.is_leaf, out.retains_grad


def _p_feature_extraction_hooks_and_grad_cam(device, wrap):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).to(device)
    store = {}

    def save_act(m, i, o):
        store["act"] = o
        o.register_hook(lambda g: store.__setitem__("grad", g))

    net[3].register_forward_hook(save_act)
    x = _randn(2, 3, 6, 6, device=device)
    logits = net(x)
    logits[torch.arange(2, device=device), logits.argmax(1)].sum().backward()
    weights = store["grad"].mean((2, 3), keepdim=True)
    cam = F.relu((weights * store["act"]).sum(1))
    cam = cam / cam.flatten(1).amax(1).clamp_min(1e-8)[:, None, None]
    return logits, cam.detach(), store["grad"]


# -- parametrizations and pruning ----------------------------------------------------------


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


class _PositiveScale(nn.Module):
    def forward(self, w):
        return F.softplus(w)

    def right_inverse(self, w):
        return torch.log(torch.expm1(w))


def _p_custom_parametrizations_cached_and_removed(device, wrap):
    import torch.nn.utils.parametrize as P

    torch.manual_seed(0)
    lin = nn.Linear(4, 4).to(device)
    P.register_parametrization(lin, "weight", _Symmetric())
    P.register_parametrization(lin, "bias", _PositiveScale())
    lin.bias = torch.full((4,), 0.5, device=device)  # right_inverse stores log(expm1(0.5))
    opt = O.Adam(lin.parameters(), lr=1e-2)
    x = _randn(6, 4, device=device)

    def step(x):
        opt.zero_grad()
        with P.cached():
            loss = lin(x).pow(2).mean() + lin.weight.abs().sum() * 1e-2
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    losses = torch.stack([step(x) for _ in range(3)])
    w = lin.weight.detach()
    names = sorted(n for n, _ in lin.named_parameters())
    P.remove_parametrizations(lin, "weight", leave_parametrized=True)
    return losses, w, torch.equal(w.cpu(), w.t().cpu()), lin.bias.detach(), names, lin.weight.detach(), P.is_parametrized(
        lin, "weight")


def _p_spectral_norm_discriminator_training(device, wrap):
    from torch.nn.utils import parametrizations as P

    torch.manual_seed(0)
    disc = nn.Sequential(P.spectral_norm(nn.Linear(4, 16)), nn.LeakyReLU(0.2), P.spectral_norm(nn.Linear(16, 1))
                         ).to(device)
    opt = O.Adam(disc.parameters(), lr=2e-3, betas=(0.0, 0.9))
    real, fake = _randn(8, 4, device=device), _randn(8, 4, seed=1, device=device) * 2

    def step(real, fake):
        opt.zero_grad()
        loss = F.relu(1 - disc(real)).mean() + F.relu(1 + disc(fake)).mean()  # hinge loss
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    losses = torch.stack([step(real, fake) for _ in range(3)])
    u = disc[0].parametrizations.weight[0]._u
    return losses, _params(disc), u, torch.linalg.matrix_norm(disc[0].weight.detach(), 2)


def _p_pruning_l1_unstructured_training(device, wrap):
    import torch.nn.utils.prune as prune

    model = _mlp(device)
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    prune.random_structured(model[2], "weight", amount=0.0, dim=0)
    opt = O.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = wrap(_train_step(model, opt, _ce))
    losses = torch.stack([step(x, y) for x, y in _batches(3, device)])
    mask = model[0].weight_mask.clone()
    zeros = (model[0].weight == 0).sum().item()
    prune.remove(model[0], "weight")
    return losses, mask, zeros, _params(model), sorted(dict(model.named_buffers()))


def _p_fuse_conv_bn_for_inference(device, wrap):
    from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5)
    lin, bn1 = nn.Linear(4, 5), nn.BatchNorm1d(5)
    conv, bn, lin, bn1 = (m.to(device) for m in (conv, bn, lin, bn1))
    x, v = _randn(4, 3, 6, 6, device=device), _randn(7, 4, seed=1, device=device)
    bn(conv(x) * 2 + 1)
    bn1(lin(v) - 1)  # populate the running statistics
    for m in (conv, bn, lin, bn1):
        m.eval()
    fused, fused_lin = fuse_conv_bn_eval(conv, bn), fuse_linear_bn_eval(lin, bn1)
    return fused(x), bn(conv(x)).detach(), fused_lin(v), bn1(lin(v)).detach(), fused.weight.detach()


# -- clipping, accumulation, optimizers -----------------------------------------------------


def _p_clip_grad_value_and_inf_norm_foreach(device, wrap):
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    model = _mlp(device)
    opt = O.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * 5).backward()
        inf = torch.nn.utils.clip_grad_norm_(model[0].parameters(), 0.05, norm_type=math.inf, foreach=True)
        torch.nn.utils.clip_grad_value_(model[2].parameters(), 0.02)
        grads = [p.grad for p in model.parameters()]
        total = get_total_norm(grads, norm_type=1.0)
        clip_grads_with_norm_(model.parameters(), 0.5, total)
        opt.step()
        return inf, total

    step = wrap(step)
    return [step(x, y) for x, y in _batches(3, device)], _params(model)


def _p_grad_accumulation_uneven_microbatches(device, wrap):
    model = _mlp(device)
    opt = O.Adam(model.parameters(), lr=1e-2)
    x, y = _batches(1, device, batch=10)[0]
    sizes = [4, 3, 3]

    def micro(x, y, weight):
        loss = F.cross_entropy(model(x), y, reduction="sum") * weight
        torch.autograd.backward([loss], grad_tensors=[torch.ones_like(loss)])
        return loss.detach()

    micro = wrap(micro)
    out = []
    for _ in range(2):
        total = sum(micro(xb, yb, 1.0 / x.shape[0]) for xb, yb in zip(x.split(sizes), y.split(sizes)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total)
    full = _mlp(device)
    full.load_state_dict(model.state_dict())
    return torch.stack(out), _params(model), F.cross_entropy(full(x), y)


def _p_param_groups_no_decay_and_warmup(device, wrap):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3)).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = O.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-2}],
                  lr=1e-2, betas=(0.9, 0.95))
    sched = O.lr_scheduler.LambdaLR(opt, [lambda s: min(1.0, (s + 1) / 3), lambda s: 0.5 ** s])
    step = wrap(_train_step(model, opt, _ce))
    losses, lrs = [], []
    for x, y in _batches(5, device):
        losses.append(step(x, y))
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return torch.stack(losses), lrs, _params(model)


def _p_optimizer_zoo_per_group_options(device, wrap):
    out = {}
    makers = {
        "rmsprop_centered": lambda a, b: O.RMSprop([{"params": a, "centered": True}, {"params": b, "lr": 1e-3}],
                                                   lr=1e-2, momentum=0.5),
        "adam_amsgrad_group": lambda a, b: O.Adam([{"params": a, "amsgrad": True}, {"params": b, "betas": (0.5, 0.9)}],
                                                  lr=1e-2),
        "nadam_decoupled": lambda a, b: O.NAdam([{"params": a}, {"params": b, "weight_decay": 0.1}], lr=1e-2,
                                                decoupled_weight_decay=True),
        "radam_adamax": lambda a, b: O.RAdam([{"params": a}, {"params": b, "lr": 5e-3}], lr=1e-2),
        "adagrad_decay": lambda a, b: O.Adagrad([{"params": a, "lr_decay": 0.1}, {"params": b}], lr=0.1),
    }
    for name, make in makers.items():
        model = _mlp(device)
        opt = make(list(model[0].parameters()), list(model[2].parameters()))
        step = wrap(_train_step(model, opt, _ce))
        out[name] = (torch.stack([step(x, y) for x, y in _batches(3, device)]), _params(model))
    return out


def _p_lbfgs_strong_wolfe_logistic_regression(device, wrap):
    torch.manual_seed(0)
    w = torch.zeros(6, 3, device=device, dtype=torch.float64, requires_grad=True)
    x, y = _batches(1, device, batch=32)[0]
    x = x.double()
    opt = O.LBFGS([w], lr=1.0, max_iter=10, history_size=5, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(x @ w, y) + 1e-2 * w.pow(2).sum()
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(2)]
    return losses, w.detach(), opt.state[w]["n_iter"], opt.state[w]["func_evals"]


def _p_sparse_adam_rejects_dense_gradients(device, wrap):
    lin = _mlp(device)
    opt = O.SparseAdam(lin.parameters(), lr=1e-2)
    x, y = _batches(1, device)[0]
    F.cross_entropy(lin(x), y).backward()
    with pytest.raises(RuntimeError, match="SparseAdam does not support dense gradients"):
        opt.step()
    with pytest.raises(ValueError):
        O.SparseAdam([torch.zeros(2, device=device, requires_grad=True)], lr=-1.0)
    return _params(lin)


def _p_reduce_lr_on_plateau_early_stopping(device, wrap):
    model = _mlp(device)
    opt = O.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = O.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=1, threshold=1e-2)
    step = wrap(_train_step(model, opt, _ce))
    val_x, val_y = _batches(1, device, seed=7)[0]
    data = _batches(2, device)
    best, bad, lrs, vals = math.inf, 0, [], []
    for epoch in range(6):
        for x, y in data:
            step(x, y)
        with torch.no_grad():
            val = F.cross_entropy(model(val_x), val_y)
        sched.step(val)  # a 0-dim device tensor: the scheduler reads it with float()
        lrs.append(opt.param_groups[0]["lr"])
        vals.append(val)
        if val.item() < best - 1e-3:
            best, bad = val.item(), 0
        else:
            bad += 1
        if bad > 3:
            break
    return torch.stack(vals), lrs, sched.num_bad_epochs, _params(model)


def _p_swa_with_buffers_and_cyclic_lr(device, wrap):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)).to(device)
    # an EMA of parameters and buffers; not the default SWA average: with use_buffers=True it divides
    # num_batches_tracked with _foreach_addcdiv_, which torch refuses for integers on foreach devices (CUDA too)
    swa = AveragedModel(model, use_buffers=True, multi_avg_fn=get_ema_multi_avg_fn(0.7))
    opt = O.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = O.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2, cycle_momentum=False)
    g = _gen(3)
    data = [(torch.randn(4, 2, 6, generator=g).to(device), torch.randint(0, 3, (4,), generator=g).to(device))
            for _ in range(4)]
    step = wrap(_train_step(model, opt, _ce))
    losses = []
    for i, (x, y) in enumerate(data):
        losses.append(step(x, y))
        sched.step()
        if i % 2 == 1:
            swa.update_parameters(model)
    loader = [x for x, _ in data]
    update_bn(loader, swa)
    swa.eval()
    return torch.stack(losses), _params(swa), swa.module[1].running_mean, swa(data[0][0])


def _p_ema_foreach_lerp_and_bias_correction(device, wrap):
    model = _mlp(device)
    ema_params = [p.detach().clone() for p in model.parameters()]
    opt = O.Adam(model.parameters(), lr=1e-2)
    decay = 0.8
    # the step count lives in a 0-dim tensor so a jitted step carries it
    count = torch.zeros((), device=device)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        with torch.no_grad():
            params = [p.detach() for p in model.parameters()]
            torch._foreach_lerp_(ema_params, params, 1 - decay)
            count.add_(1)
            corr = 1 - decay ** count
            debiased = torch._foreach_div(ema_params, corr)
            torch._foreach_mul_(params, 1.0)  # in place on the live weights: a no-op that must stay one
        return loss, debiased

    step = wrap(step)
    outs = [step(x, y) for x, y in _batches(4, device)]
    return outs, ema_params, count


def _p_custom_optimizer_subclass(device, wrap):
    class SignSGDMomentum(O.Optimizer):
        def __init__(self, params, lr=1e-2, beta=0.9):
            super().__init__(params, dict(lr=lr, beta=beta))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["buf"] = torch.zeros_like(p)
                        state["step"] = torch.tensor(0.0, device=p.device)
                    state["step"] += 1
                    state["buf"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                    p.add_(state["buf"].sign(), alpha=-group["lr"])

    model = _mlp(device)
    opt = SignSGDMomentum([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 5e-3}])
    step = wrap(_train_step(model, opt, _ce))
    losses = torch.stack([step(x, y) for x, y in _batches(3, device)])
    sd = opt.state_dict()
    return losses, _params(model), sd["state"][0]["buf"], sd["state"][3]["step"], sd["param_groups"][1]["lr"]


# -- checkpoints --------------------------------------------------------------------------


class _Backbone(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.head = nn.Linear(8, classes)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.head(self.body(x))


def _p_partial_load_strict_false_new_head(device, wrap):
    torch.manual_seed(0)
    pre = _Backbone().to(device)
    pre(_randn(2, 6, device=device))
    buf = io.BytesIO()
    torch.save(pre.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    sd["extra.weight"] = torch.zeros(1, device=device)
    del sd["head.bias"]
    torch.manual_seed(1)
    fine = _Backbone(classes=5).to(device)
    sd = {k: v for k, v in sd.items() if not k.startswith("head.weight")}
    result = fine.load_state_dict(sd, strict=False)
    for p in fine.body.parameters():
        p.requires_grad_(False)
    opt = O.SGD([p for p in fine.parameters() if p.requires_grad], lr=0.1)
    x, y = _batches(1, device)[0]
    step = wrap(_train_step(fine, opt, _ce))
    losses = torch.stack([step(x, y) for _ in range(3)])
    assigned = _Backbone().to(device)
    assigned.load_state_dict(pre.state_dict(), assign=True)
    return (sorted(result.missing_keys), sorted(result.unexpected_keys), losses, _params(fine), fine.calls,
            sorted(fine.state_dict()), assigned.head.weight is pre.head.weight or torch.equal(
                assigned.head.weight.detach().cpu(), pre.head.weight.detach().cpu()))


def _p_optimizer_state_resume_into_jitted_step(device, wrap):
    def make(seed=0):
        model = _mlp(device, seed=seed)
        opt = O.SGD([{"params": model[0].parameters(), "momentum": 0.9, "nesterov": True},
                     {"params": model[2].parameters(), "momentum": 0.5, "lr": 0.05}], lr=0.1, weight_decay=1e-3)
        return model, opt

    data = _batches(4, device)
    model, opt = make()
    step = _train_step(model, opt, _ce)
    for x, y in data[:2]:
        step(x, y)
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict(), "epoch": 2}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True, map_location=device)
    model2, opt2 = make(seed=4)
    model2.load_state_dict(ck["m"])
    opt2.load_state_dict(ck["o"])
    step2 = wrap(_train_step(model2, opt2, _ce))
    losses = torch.stack([step2(x, y) for x, y in data[2:]])
    moms = [opt2.state[p]["momentum_buffer"] for p in model2.parameters()]
    # the loaded optimizer state does not alias the checkpoint
    return losses, _params(model2), moms, ck["o"]["state"][0]["momentum_buffer"], ck["epoch"]


def _p_module_buffers_apply_and_dtype_round_trip(device, wrap):
    torch.manual_seed(0)
    model = _Backbone().to(device)

    def init(m):
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.bias, 0.1)
            with torch.no_grad():
                m.weight.mul_(2.0)

    model.apply(init)
    x = _randn(3, 6, device=device)
    before = model(x)
    model.half()
    half_out = model(x.half())
    model.float()
    dt = {n: b.dtype for n, b in model.named_buffers()}
    sd = model.state_dict()
    return before, half_out, model(x), dt, sorted(sd), model.calls, [n for n, _ in model.named_modules()]


# -- views and in-place -------------------------------------------------------------------


def _p_inplace_chains_on_views(device, wrap):
    x = _randn(4, 6, device=device)

    def f(x):
        y = x.clone()
        y.t().unsqueeze(0)[0, 1:3].add_(10.0)
        a, b = y.chunk(2, dim=1)
        a.clamp_(-0.5, 0.5)
        for piece in y.split([1, 3], dim=0)[1].unbind(0):
            piece.mul_(2)
        y.as_strided((2, 2), (7, 1), 1).masked_fill_(torch.tensor([[True, False], [False, True]],
                                                                   device=x.device), -3.0)
        b.transpose(0, 1)[-1].sub_(b[:, 0])
        z = y.view(2, 12)
        z[1].div_(4)
        y.unflatten(1, (2, 3)).movedim(2, 0)[0].zero_()
        return y, a, b

    return wrap(f)(x)


def _p_index_ops_on_views(device, wrap):
    x = _randn(5, 6, device=device)
    idx = torch.tensor([2, 0, 2]).to(device)
    src = _randn(3, 4, seed=1, device=device)

    def f(x, idx, src):
        y = x.clone()
        y[:, 1:5].index_add_(0, idx, src, alpha=0.5)
        y.t()[2:].index_copy_(1, torch.tensor([4, 1, 3]).to(x.device), src.t() * 2)
        y[1].scatter_reduce_(0, torch.tensor([0, 0, 5, 5]).to(x.device), src[0], "amax", include_self=False)
        y[::2, ::2].index_fill_(1, torch.tensor([1]).to(x.device), 7.0)
        y.diagonal(1).scatter_(0, torch.tensor([0, 3]).to(x.device), -1.0)
        w = y.narrow(0, 3, 2)
        w.index_put_((torch.tensor([1, 0, 1]).to(x.device), torch.tensor([0, 2, 0]).to(x.device)),
                     torch.tensor([1.0, 2.0, 3.0], device=x.device), accumulate=True)
        return y, w

    return wrap(f)(x, idx, src)


def _p_data_assignment_and_requires_grad_toggling(device, wrap):
    model = _mlp(device)
    opt = O.SGD(model.parameters(), lr=0.1)
    step = _train_step(model, opt, _ce)
    data = _batches(4, device)
    losses = [step(*data[0])]
    model[0].weight.data = model[0].weight.data * 0.5  # rebinding .data keeps the Parameter and its optimizer
    model[2].bias.data.fill_(0.25)
    model[0].requires_grad_(False)
    losses.append(step(*data[1]))
    frozen_grad = model[0].weight.grad
    model[0].requires_grad_(True)
    losses.append(step(*data[2]))
    p = model[2].weight
    p.data = torch.zeros(3, 16, device=device)
    wgt = p.detach()
    wgt[0, 0] = 5.0  # detach shares storage with the new data
    losses.append(step(*data[3]))
    return torch.stack(losses), _params(model), frozen_grad is None or frozen_grad.abs().sum().item() >= 0, isinstance(
        p, nn.Parameter), p.requires_grad


def _p_masks_nonzero_and_boolean_assignment(device, wrap):
    scores = _randn(4, 5, device=device)
    labels = torch.tensor([0, 1, 1, 0, 2]).to(device)
    keep = scores > 0.2
    rows, cols = keep.nonzero(as_tuple=True)
    picked = scores.masked_select(keep)
    pruned = scores.clone()
    pruned[~keep] = 0.0
    pruned[keep] *= 2
    per_class = torch.stack([scores[:, labels == c].sum(1) for c in range(3)], 1)
    first_hit = torch.where(keep.any(1), keep.float().argmax(1), -1)
    clipped = torch.where(scores.abs() > 1, scores.sign(), scores)
    return rows, cols, picked, pruned, per_class, first_hit, clipped, keep.sum().item(), torch.nonzero(labels == 1)


def _p_unique_inverse_embedding_dedup(device, wrap):
    torch.manual_seed(0)
    emb = nn.Embedding(20, 4).to(device)
    ids = torch.tensor([[5, 3, 5, 19], [3, 3, 0, 7]]).to(device)
    uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    rows = emb(uniq)
    out = rows[inverse]  # the gather from the deduplicated table equals the direct lookup
    (out * _randn(2, 4, 4, device=device)).sum().backward()
    vals, order = torch.sort(ids.flatten(), stable=True)
    top = torch.topk(_randn(10, device=device), 4, sorted=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(order.numel(), device=device)
    dims = torch.unique(torch.tensor([[1, 2], [1, 2], [0, 5]]).to(device), dim=0, return_inverse=True)
    return uniq, inverse, counts, out, emb.weight.grad, vals, order, ranks, top.values, top.indices, dims


def _p_cumulative_ops_with_dtypes(device, wrap):
    i = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32).to(device)
    b = torch.tensor([True, False, True, True]).to(device)
    h = _randn(6, device=device).half()

    def f(i, b, h):
        return (i.cumsum(1), i.cumsum(0, dtype=torch.float64), i.cumprod(1), i.cumprod(1, dtype=torch.float32),
                b.cumsum(0), b.cumprod(0), h.cumsum(0), h.cumsum(0, dtype=torch.float32), torch.cumsum(
                    i.to(torch.uint8), 1), torch.cummin(i.flip(1), 1).values, i.sum(dtype=torch.int16),
                i.prod(1, dtype=torch.float64), h.float().cumprod(0).to(torch.bfloat16))

    return wrap(f)(i, b, h)


def _p_einsum_chains_bilinear_attention(device, wrap):
    torch.manual_seed(0)
    w_q, w_k, w_v = (nn.Parameter(_randn(8, 2, 4, seed=s, device=device) * 0.3) for s in range(3))
    bil = nn.Bilinear(8, 8, 2).to(device)
    opt = O.Adam([w_q, w_k, w_v, *bil.parameters()], lr=1e-2)
    x = _randn(3, 5, 8, seed=4, device=device)

    def step(x):
        opt.zero_grad()
        q, k, v = (torch.einsum("bld,dhe->bhle", x, w) for w in (w_q, w_k, w_v))
        att = torch.einsum("bhqe,bhke->bhqk", q, k).div(2.0).softmax(-1)
        o = torch.einsum("bhqk,bhke->bqhe", att, v).flatten(2)
        pairs = torch.einsum("bi,bj,kij->bk", o[:, 0], o[:, -1], bil.weight) + bil.bias
        loss = (pairs - bil(o[:, 0], o[:, -1])).abs().sum() + pairs.pow(2).mean() + torch.einsum("bqd,bqd->", o,
                                                                                                   o) * 1e-2
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    return torch.stack([step(x) for _ in range(3)]), w_q.detach(), _params(bil)


class _SpectralConv1d(nn.Module):
    """The Fourier layer of a Fourier neural operator: complex weights on the lowest modes."""

    def __init__(self, channels, modes):
        super().__init__()
        self.modes = modes
        scale = 1 / channels
        g = _gen(9)
        self.weight = nn.Parameter(scale * torch.randn(channels, channels, modes, 2, generator=g))

    def forward(self, x):
        xf = torch.fft.rfft(x, norm="ortho")
        w = torch.view_as_complex(self.weight)
        out = torch.zeros_like(xf)
        out[..., :self.modes] = torch.einsum("bim,iom->bom", xf[..., :self.modes], w)
        return torch.fft.irfft(out, n=x.shape[-1], norm="ortho")


def _p_fourier_neural_operator_complex_weights(device, wrap):
    torch.manual_seed(0)
    layer = _SpectralConv1d(3, 4).to(device)
    opt = O.Adam(layer.parameters(), lr=1e-2)
    x = _randn(2, 3, 16, device=device)
    target = torch.roll(x, 2, -1)

    def step(x, target):
        opt.zero_grad()
        loss = F.mse_loss(layer(x), target)
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    losses = torch.stack([step(x, target) for _ in range(3)])
    z = torch.fft.fft2(x)
    back = torch.fft.ifft2(z).real
    shifted = torch.fft.ifftshift(torch.fft.fftshift(z, dim=-1), dim=-1)
    as_real = torch.view_as_real(z)
    as_real[..., 1].zero_()  # a view: writing it drops the imaginary parts of z
    return losses, _params(layer), back, shifted, z, torch.fft.rfftfreq(8, d=0.5).to(device), torch.fft.irfftn(
        torch.fft.rfftn(x, dim=(-2, -1)), s=x.shape[-2:], dim=(-2, -1))


# -- RNG ----------------------------------------------------------------------------------


def _p_seeded_training_is_reproducible(device, wrap):
    def run():
        torch.manual_seed(123)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)).to(device)
        model[0].weight.data = _randn(16, 6, device=device) * 0.3  # the same weights on both devices
        opt = O.SGD(model.parameters(), lr=0.1)
        step = wrap(_train_step(model, opt, _ce))
        torch.manual_seed(7)
        return torch.stack([step(x, y) for x, y in _batches(3, device)])

    a, b = run(), run()
    torch.manual_seed(8)
    c = run()
    torch.manual_seed(7)
    noise = torch.randn(3, device=device)
    return torch.equal(a.cpu(), b.cpu()), torch.equal(a.cpu(), c.cpu()), a.shape, noise.shape, bool(a.isfinite().all())


def _p_generator_objects_in_sampling(device, wrap):
    gen_device = "cpu" if device == "cpu" else device

    def draw(seed):
        g = torch.Generator(device=gen_device).manual_seed(seed)
        return (torch.randn(4, device=device, generator=g), torch.randperm(7, device=device, generator=g),
                torch.multinomial(torch.tensor([0.1, 0.0, 0.9], device=device), 5, replacement=True, generator=g),
                torch.bernoulli(torch.full((6,), 0.5, device=device), generator=g),
                torch.empty(5, device=device).uniform_(2, 3, generator=g),
                torch.rand(3, device=device, generator=g))

    a, b, c = draw(1), draw(1), draw(2)
    g = torch.Generator(device=gen_device).manual_seed(5)
    state = g.get_state()
    x1 = torch.randn(3, device=device, generator=g)
    g.set_state(state)
    x2 = torch.randn(3, device=device, generator=g)
    same = all(torch.equal(u.cpu(), v.cpu()) for u, v in zip(a, b))
    differ = not torch.equal(a[0].cpu(), c[0].cpu())
    perm_ok = sorted(a[1].tolist()) == list(range(7))
    multi_ok = not (a[2] == 1).any().item()
    uni_ok = bool(((a[4] >= 2) & (a[4] < 3)).all())
    return same, differ, perm_ok, multi_ok, uni_ok, torch.equal(x1.cpu(), x2.cpu()), g.initial_seed(), [t.dtype for t in
                                                                                                          a]


def _p_rng_state_checkpoint_and_fork(device, wrap):
    rng = torch if device == "cpu" else getattr(torch, device)  # torch.jax mirrors torch.cuda's RNG functions
    fork = dict(devices=[]) if device == "cpu" else dict(device_type=device)
    torch.manual_seed(0)
    torch.randn(2, device=device)
    state = rng.get_rng_state()
    drop1 = F.dropout(torch.ones(50, device=device), 0.5)
    with torch.random.fork_rng(**fork):
        torch.manual_seed(99)
        inside = F.dropout(torch.ones(50, device=device), 0.5)
    after_fork = F.dropout(torch.ones(50, device=device), 0.5)
    rng.set_rng_state(state)
    drop1_again = F.dropout(torch.ones(50, device=device), 0.5)
    after_again = F.dropout(torch.ones(50, device=device), 0.5)
    return (torch.equal(drop1.cpu(), drop1_again.cpu()), torch.equal(after_fork.cpu(), after_again.cpu()),
            torch.equal(inside.cpu(), drop1.cpu()), state.dtype)


def _p_rsample_gradients_match_analytic(device, wrap):
    from torch import distributions as D

    torch.manual_seed(0)
    n = 40000
    loc = torch.tensor([0.5, -1.0], device=device, requires_grad=True)
    log_scale = torch.tensor([0.0, -0.5], device=device, requires_grad=True)
    z = D.Normal(loc, log_scale.exp()).rsample((n,))
    (z.pow(2).mean(0).sum()).backward()  # E[z^2] = mu^2 + s^2: d/dmu = 2 mu, d/dlog s = 2 s^2
    want_loc, want_ls = 2 * loc.detach().cpu(), 2 * log_scale.detach().exp().cpu() ** 2
    lognorm = D.LogNormal(loc.detach(), 0.5).rsample((n,))
    rate = torch.tensor(2.0, device=device, requires_grad=True)
    e = D.Exponential(rate).rsample((n,))
    e.mean().backward()  # E = 1/rate: d/drate = -1/rate^2
    relaxed = D.RelaxedOneHotCategorical(torch.tensor(0.5, device=device),
                                         logits=torch.tensor([0.0, 1.0, 2.0], device=device)).rsample((5,))
    tol = 8 / math.sqrt(n)
    return ((loc.grad.cpu() - want_loc).abs() < tol * 3).tolist(), ((log_scale.grad.cpu() - want_ls).abs() < tol * 3
                                                                     ).tolist(), abs(rate.grad.item() + 0.25) < tol, (
        lognorm > 0).all().item(), torch.allclose(relaxed.sum(-1).cpu(), torch.ones(5)), relaxed.shape, z.requires_grad


# -- precision ----------------------------------------------------------------------------


def _p_bf16_model_with_fp32_master_weights(device, wrap):
    model = _mlp(device)
    master = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = O.SGD(master, lr=0.1, momentum=0.9)

    def step(x, y):
        for p in model.parameters():
            p.grad = None
        out = model(x.to(torch.bfloat16))
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)  # float32 -> bfloat16 in the copy
        return loss, out.dtype

    step = wrap(step)
    return [step(x, y) for x, y in _batches(3, device)], master, _params(model)


def _p_autocast_cpu_style_mixed_matmuls(device, wrap):
    a = _randn(4, 8, device=device)
    b = _randn(8, 3, seed=1, device=device)

    def f(a, b):
        ah, bh = a.to(torch.float16), b.to(torch.bfloat16)
        out = {
            "half_mm": (ah @ b.half()),
            "bf16_mm": (a.bfloat16() @ bh),
            "mixed_add": ah + b.T[:, :4].T.float().sum(),
            "upcast_sum": ah.sum(dtype=torch.float32),
            "softmax_f32": torch.softmax(ah, -1, dtype=torch.float32),
            "roundtrip": a.half().float() - a,
            "int_cast": (a * 100).to(torch.int16).to(torch.float64),
            "type_as": bh.type_as(a),
        }
        return out

    return wrap(f)(a, b)


# -- sequences ------------------------------------------------------------------------------


def _p_packed_lstm_classifier_training(device, wrap):
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    emb, lstm, head = nn.Embedding(12, 5, padding_idx=0), nn.LSTM(5, 6, batch_first=True), nn.Linear(6, 2)
    emb, lstm, head = emb.to(device), lstm.to(device), head.to(device)
    # not Adam: weight_hh's first gradients are tiny (h0 = 0), and Adam would scale their rounding up
    opt = O.SGD([*emb.parameters(), *lstm.parameters(), *head.parameters()], lr=0.2, momentum=0.9)
    ids = torch.tensor([[3, 4, 5, 6], [7, 2, 0, 0], [1, 9, 8, 0]]).to(device)
    lengths = torch.tensor([4, 2, 3])  # on the host, as pack_padded_sequence requires
    labels = torch.tensor([1, 0, 1]).to(device)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        packed = pack_padded_sequence(emb(ids), lengths, batch_first=True, enforce_sorted=False)
        out, (h, _) = lstm(packed)
        padded, lens = pad_packed_sequence(out, batch_first=True, total_length=5)
        loss = F.cross_entropy(head(h[-1]), labels) + padded.pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), padded.detach(), lens.tolist(), _params(lstm), emb.weight.grad[0]


def _p_kv_cache_incremental_decoding(device, wrap):
    torch.manual_seed(0)
    qkv, proj = nn.Linear(8, 24).to(device), nn.Linear(8, 8).to(device)
    prompt = _randn(1, 4, 8, device=device)
    cache_k = torch.zeros(1, 2, 8, 4, device=device)
    cache_v = torch.zeros(1, 2, 8, 4, device=device)

    def attend(x, pos):
        b, t, _ = x.shape
        q, k, v = qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        cache_k[:, :, pos:pos + t] = k
        cache_v.narrow(2, pos, t).copy_(v)
        keys, vals = cache_k[:, :, :pos + t], cache_v[:, :, :pos + t]
        mask = torch.ones(t, pos + t, dtype=torch.bool, device=x.device).tril(pos)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return proj(o.transpose(1, 2).reshape(b, t, 8))

    with torch.no_grad():
        full = attend(prompt, 0)
        cache_k.zero_()
        cache_v.zero_()
        steps = [attend(prompt[:, :3], 0)[:, -1]]
        step = wrap(lambda x: attend(x, 3))
        steps.append(step(prompt[:, 3:])[:, -1])
    return full, steps, cache_k, cache_v


def _p_wavenet_causal_dilated_conv(device, wrap):
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, ch, dilation):
            super().__init__()
            self.pad = (2 - 1) * dilation
            self.conv = nn.Conv1d(ch, 2 * ch, 2, dilation=dilation)
            self.res = nn.Conv1d(ch, ch, 1)

        def forward(self, x):
            h = self.conv(F.pad(x, (self.pad, 0)))
            a, g = h.chunk(2, 1)
            return x + self.res(torch.tanh(a) * torch.sigmoid(g))

    net = nn.Sequential(nn.Conv1d(1, 4, 1), *[Block(4, d) for d in (1, 2, 4)], nn.Conv1d(4, 8, 1)).to(device)
    opt = O.Adam(net.parameters(), lr=3e-3)
    sig = torch.sin(torch.linspace(0, 12, 33)).to(device)
    target = ((sig[1:] + 1) * 3.5).round().long().clamp(0, 7)[None]

    def step(x, t):
        opt.zero_grad()
        logits = net(x)
        loss = F.cross_entropy(logits, t)
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    return torch.stack([step(sig[None, None, :-1], target) for _ in range(3)]), _params(net)


# -- spatial ops ---------------------------------------------------------------------------


def _p_spatial_transformer_affine_grid(device, wrap):
    torch.manual_seed(0)
    loc = nn.Sequential(nn.Flatten(), nn.Linear(2 * 6 * 6, 6)).to(device)
    with torch.no_grad():
        loc[1].weight.mul_(0.01)
        loc[1].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))
    opt = O.SGD(loc.parameters(), lr=0.1)
    img = _randn(3, 2, 6, 6, device=device)
    target = torch.flip(img, (-1,))

    def step(img, target):
        opt.zero_grad()
        theta = loc(img).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(img.shape), align_corners=False)
        warped = F.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=False)
        near = F.grid_sample(img, grid.clamp(-1, 1), mode="nearest", padding_mode="zeros", align_corners=True)
        loss = F.l1_loss(warped, target) + 0.0 * near.sum()
        loss.backward()
        opt.step()
        return loss, warped.detach()

    step = wrap(step)
    return [step(img, target) for _ in range(2)], _params(loc)


def _p_unfold_fold_patches(device, wrap):
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, stride=2).to(device)
    x = _randn(2, 2, 7, 7, device=device).requires_grad_()

    def f(x):
        cols = F.unfold(x, 3, padding=1, stride=2)
        im2col = (conv.weight.view(3, -1) @ cols + conv.bias[:, None]).view(2, 3, 4, 4)
        patches = F.unfold(x, kernel_size=(2, 3), dilation=(1, 2), stride=1)
        count = F.fold(torch.ones_like(patches), (7, 7), kernel_size=(2, 3), dilation=(1, 2))
        recon = F.fold(patches, (7, 7), kernel_size=(2, 3), dilation=(1, 2)) / count
        tiles = x.unfold(2, 3, 2).unfold(3, 3, 2)  # Tensor.unfold: sliding windows as a view
        loss = im2col.pow(2).sum() + recon.sum() + tiles.mean()
        loss.backward()
        return im2col.detach(), conv(x).detach(), recon.detach(), tiles.detach(), x.grad, conv.weight.grad

    return wrap(f)(x)


def _p_interpolate_upsampling_decoder(device, wrap):
    torch.manual_seed(0)
    up = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False), nn.Conv2d(3, 3, 3, padding=1),
                       nn.ReLU(), nn.Upsample(size=(11, 9), mode="nearest"), nn.ConvTranspose2d(3, 2, 2, stride=1),
                       nn.PixelUnshuffle(2) if False else nn.Identity()).to(device)
    opt = O.SGD(up.parameters(), lr=0.05, momentum=0.9)
    x = _randn(2, 3, 4, 4, device=device)
    target = _randn(2, 2, 12, 10, seed=1, device=device)

    def step(x):
        opt.zero_grad()
        out = up(x)
        small = F.interpolate(out, scale_factor=0.5, mode="bicubic", align_corners=True, antialias=False)
        area = F.adaptive_avg_pool2d(out, (3, 5))
        loss = F.mse_loss(out, target) + small.abs().mean() + area.pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    return torch.stack([step(x) for _ in range(3)]), _params(up)


# -- attention ----------------------------------------------------------------------------


def _rope(x, pos):
    d = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(d, device=x.device, dtype=torch.float32) / d))
    ang = pos[:, None].float() * freqs[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def _p_rotary_attention_block_sdpa_masks(device, wrap):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    qkv, out_proj, norm = nn.Linear(16, 48, bias=False), nn.Linear(16, 16), nn.RMSNorm(16)
    mods = nn.ModuleList([qkv, out_proj, norm]).to(device)
    opt = O.AdamW(mods.parameters(), lr=1e-2)
    x = _randn(2, 6, 16, device=device)
    pad = torch.tensor([[True] * 6, [True] * 4 + [False] * 2]).to(device)  # True = attend
    bias = torch.zeros(6, 6, device=device).masked_fill(
        torch.ones(6, 6, dtype=torch.bool, device=device).triu(1), float("-inf"))

    def step(x, pad):
        opt.zero_grad()
        h = norm(x)
        q, k, v = qkv(h).view(2, 6, 3, 4, 4).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(6, device=x.device)
        q, k = _rope(q, pos), _rope(k, pos)
        with sdpa_kernel(SDPBackend.MATH):
            o1 = F.scaled_dot_product_attention(q, k, v, attn_mask=pad[:, None, None, :])
            o2 = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        out = x + out_proj((o1 + o2).transpose(1, 2).reshape(2, 6, 16))
        loss = (out.pow(2) * pad[..., None]).sum() / (pad.sum() * 16)
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    return torch.stack([step(x, pad) for _ in range(3)]), _params(mods)


def _p_mixture_of_experts_topk_routing(device, wrap):
    torch.manual_seed(0)
    n_exp, k = 4, 2
    gate = nn.Linear(8, n_exp, bias=False).to(device)
    experts = nn.ModuleList([nn.Sequential(nn.Linear(8, 12), nn.SiLU(), nn.Linear(12, 8)) for _ in range(n_exp)]
                            ).to(device)
    opt = O.Adam([*gate.parameters(), *experts.parameters()], lr=1e-2)
    x = _randn(10, 8, device=device)

    def step(x):
        opt.zero_grad()
        probs = gate(x).softmax(-1)
        w, idx = probs.topk(k, -1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(n_exp):
            hit = (idx == e).to(x.dtype)  # dense dispatch keeps shapes static for jit
            weight = (w * hit).sum(-1, keepdim=True)
            out = out + weight * experts[e](x)
        load = F.one_hot(idx[:, 0], n_exp).float().mean(0)
        aux = n_exp * (load * probs.mean(0)).sum()
        loss = (out - x).pow(2).mean() + 0.01 * aux
        loss.backward()
        opt.step()
        return loss, idx

    step = wrap(step)
    return [step(x) for _ in range(3)], _params(gate)


# -- small research models -----------------------------------------------------------------


class _VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
        self.dec = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x, eps):
        mu, logvar = self.enc(x).chunk(2, -1)
        z = mu + eps * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


def _p_tiny_vae_training(device, wrap):
    torch.manual_seed(0)
    vae = _VAE().to(device)
    opt = O.Adam(vae.parameters(), lr=1e-2)
    x = torch.sigmoid(_randn(8, 10, device=device) * 2)
    eps = [_randn(8, 2, seed=10 + i, device=device) for i in range(3)]

    def step(x, eps):
        opt.zero_grad()
        logits, mu, logvar = vae(x, eps)
        rec = F.binary_cross_entropy_with_logits(logits, x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.shape[0]
        loss = rec + kl
        loss.backward()
        opt.step()
        return loss, kl.detach()

    step = wrap(step)
    return [step(x, e) for e in eps], _params(vae)


class _Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4 + 8, 32), nn.SiLU(), nn.Linear(32, 4))
        betas = torch.linspace(1e-4, 0.2, 20)
        self.register_buffer("alpha_bar", torch.cumprod(1 - betas, 0))

    def time_embedding(self, t):
        half = 4
        freqs = torch.exp(-math.log(1000) * torch.arange(half, device=t.device) / half)
        ang = t.float()[:, None] * freqs[None]
        return torch.cat([ang.sin(), ang.cos()], -1)

    def forward(self, x, t):
        return self.net(torch.cat([x, self.time_embedding(t)], -1))


def _p_tiny_diffusion_training_step(device, wrap):
    torch.manual_seed(0)
    model = _Denoiser().to(device)
    opt = O.AdamW(model.parameters(), lr=2e-3)
    x0 = _randn(16, 4, device=device)
    ts = [torch.randint(0, 20, (16,), generator=_gen(i)).to(device) for i in range(3)]
    noises = [_randn(16, 4, seed=20 + i, device=device) for i in range(3)]

    def step(x0, t, noise):
        opt.zero_grad()
        ab = model.alpha_bar.gather(0, t)[:, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        loss = F.mse_loss(model(xt, t), noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    step = wrap(step)
    losses = torch.stack([step(x0, t, n) for t, n in zip(ts, noises)])
    with torch.no_grad():  # one deterministic DDIM step from t=10 to t=5
        xt = noises[0]
        t = torch.full((16,), 10, device=device, dtype=torch.long)
        eps = model(xt, t)
        a_t, a_s = model.alpha_bar[10], model.alpha_bar[5]
        x0_hat = (xt - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        xs = a_s.sqrt() * x0_hat + (1 - a_s).sqrt() * eps
    return losses, _params(model), xs


def _info_nce(z1, z2, tau):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.T / tau
    n = z1.shape[0]
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, target)


def _p_simclr_contrastive_loss(device, wrap):
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8)).to(device)
    opt = O.SGD(enc.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    x = _randn(8, 6, device=device)
    aug1, aug2 = x + 0.1 * _randn(8, 6, seed=1, device=device), x * 0.9

    def step(a, b):
        opt.zero_grad()
        loss = _info_nce(enc(a), enc(b), 0.5)
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    losses = torch.stack([step(aug1, aug2) for _ in range(3)])
    return losses, _params(enc), enc[1].running_mean


def _p_triplet_hard_negative_mining(device, wrap):
    torch.manual_seed(0)
    # no bias on the last layer: distances cancel it, and Adam would turn its rounding-noise gradient into steps
    emb = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4, bias=False)).to(device)
    opt = O.Adam(emb.parameters(), lr=1e-2)
    x = _randn(12, 6, device=device)
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]).to(device)

    def step(x, labels):
        opt.zero_grad()
        e = emb(x)
        d = torch.cdist(e, e)
        same = labels[:, None] == labels[None]
        hardest_pos = (d * same).amax(1)
        hardest_neg = d.masked_fill(same, float("inf")).amin(1)
        loss = F.relu(hardest_pos - hardest_neg + 0.5).mean()
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    return torch.stack([step(x, labels) for _ in range(3)]), _params(emb)


def _p_gcn_message_passing_index_add(device, wrap):
    torch.manual_seed(0)
    n = 7
    edges = torch.tensor([[0, 1, 1, 2, 3, 4, 5, 6, 2], [1, 0, 2, 1, 4, 3, 6, 5, 5]]).to(device)
    lin1, lin2 = nn.Linear(5, 8).to(device), nn.Linear(8, 2).to(device)
    opt = O.Adam([*lin1.parameters(), *lin2.parameters()], lr=1e-2)
    feats = _randn(n, 5, device=device)
    y = torch.tensor([0, 0, 1, 1, 0, 1, 1]).to(device)

    def propagate(h, src, dst):
        deg = torch.zeros(n, device=h.device).index_add_(0, dst, torch.ones_like(dst, dtype=h.dtype)) + 1
        norm = (deg[src] * deg[dst]).rsqrt()
        out = h / deg[:, None]  # the self loop
        return out.index_add(0, dst, h[src] * norm[:, None])

    def step(feats, edges):
        opt.zero_grad()
        src, dst = edges
        h = F.relu(propagate(lin1(feats), src, dst))
        # a max aggregation beside the sum: scatter_reduce with amax, then a readout
        pooled = torch.zeros(n, 8, device=h.device).scatter_reduce(0, dst[:, None].expand(-1, 8), h[src], "amax",
                                                                      include_self=False)
        logits = lin2(propagate(h + pooled, src, dst))
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        return loss, logits.detach()

    step = wrap(step)
    return [step(feats, edges) for _ in range(3)], _params(lin1)


def _p_knowledge_distillation_with_temperature(device, wrap):
    teacher = _mlp(device, seed=3, sizes=(6, 32, 3)).eval()
    student = _mlp(device, seed=4, sizes=(6, 8, 3))
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = O.SGD(student.parameters(), lr=0.2)
    T = 2.0

    def step(x, y):
        opt.zero_grad()
        with torch.no_grad():
            soft = F.softmax(teacher(x) / T, -1)
        logits = student(x)
        kd = F.kl_div(F.log_softmax(logits / T, -1), soft, reduction="batchmean") * T * T
        loss = 0.7 * kd + 0.3 * F.cross_entropy(logits, y, label_smoothing=0.05)
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    return torch.stack([step(x, y) for x, y in _batches(3, device)]), _params(student), all(
        p.grad is None for p in teacher.parameters())


def _p_straight_through_vector_quantizer(device, wrap):
    torch.manual_seed(0)
    enc, dec = nn.Linear(6, 4).to(device), nn.Linear(4, 6).to(device)
    codebook = nn.Embedding(5, 4).to(device)
    opt = O.Adam([*enc.parameters(), *dec.parameters(), *codebook.parameters()], lr=1e-2)
    x = _randn(10, 6, device=device)

    def step(x):
        opt.zero_grad()
        z = enc(x)
        d = (z.pow(2).sum(1, keepdim=True) - 2 * z @ codebook.weight.T + codebook.weight.pow(2).sum(1))
        codes = d.argmin(1)
        q = codebook(codes)
        commit = F.mse_loss(z, q.detach())
        vq = F.mse_loss(q, z.detach())
        q_st = z + (q - z).detach()  # straight-through estimator
        loss = F.mse_loss(dec(q_st), x) + vq + 0.25 * commit
        loss.backward()
        opt.step()
        usage = F.one_hot(codes, 5).sum(0)  # bincount's length depends on the values: not for jit
        return loss, codes, usage

    step = wrap(step)
    return [step(x) for _ in range(3)], _params(codebook)


def _p_dataloader_over_device_tensors(device, wrap):
    from torch.utils.data import DataLoader, TensorDataset, random_split

    x, y = _batches(1, device, batch=12)[0]
    ds = TensorDataset(x, y)
    train, val = random_split(ds, [9, 3], generator=_gen(2))
    loader = DataLoader(train, batch_size=4, shuffle=True, generator=_gen(3), drop_last=False)
    model = _mlp(device)
    opt = O.SGD(model.parameters(), lr=0.1)
    step = wrap(_train_step(model, opt, _ce))
    losses, sizes = [], []
    for epoch in range(2):
        for xb, yb in loader:
            sizes.append(xb.shape[0])
            losses.append(step(xb, yb))
    vx, vy = next(iter(DataLoader(val, batch_size=3)))
    return losses, sizes, _params(model), vx, vy


def _p_welford_running_stats_buffers(device, wrap):
    class RunningNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))
            self.register_buffer("mean", torch.zeros(dim))
            self.register_buffer("m2", torch.zeros(dim))

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    n = x.shape[0]
                    delta = x.mean(0) - self.mean
                    total = self.count + n
                    self.mean.add_(delta * n / total)
                    self.m2.add_(x.var(0, unbiased=False) * n + delta.pow(2) * self.count * n / total)
                    self.count.copy_(total)
            std = (self.m2 / self.count.clamp(min=1)).sqrt().clamp(min=1e-3)
            return (x - self.mean) / std

    norm = RunningNorm(6).to(device)
    model = _mlp(device)
    opt = O.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(norm(x * 3 + 1)), y)
        loss.backward()
        opt.step()
        return loss

    step = wrap(step)
    data = _batches(4, device)
    losses = torch.stack([step(x, y) for x, y in data])
    allx = torch.cat([x for x, _ in data]) * 3 + 1
    return losses, norm.mean, norm.m2 / norm.count, norm.count, allx.mean(0), allx.var(0, unbiased=False)


def _p_dqn_target_network_deepcopy_and_sync(device, wrap):
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    target = copy.deepcopy(online)  # the usual way to make the target network
    target.requires_grad_(False)
    opt = O.Adam(online.parameters(), lr=1e-3)
    g = _gen(5)
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g), torch.randn(8, generator=g),
                torch.randn(8, 4, generator=g), (torch.rand(8, generator=g) < 0.2).float()) for _ in range(4)]

    def step(s, a, r, s2, done, q_next):
        opt.zero_grad()
        q = online(s).gather(1, a[:, None]).squeeze(1)
        y = r + 0.9 * (1 - done) * q_next
        loss = F.smooth_l1_loss(q, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(online.parameters(), 10.0)
        opt.step()
        return loss

    step = wrap(step)
    losses, q_nexts = [], []
    for i, batch in enumerate(batches):
        s, a, r, s2, done = (t.to(device) for t in batch)
        with torch.no_grad():
            q_next = target(s2).max(1).values  # the target network is read outside the compiled step
        q_nexts.append(q_next)
        losses.append(step(s, a, r, s2, done, q_next))
        if i == 1:
            target.load_state_dict(online.state_dict())
    return torch.stack(losses), torch.stack(q_nexts), _params(target), _params(online)


class _ScaledTanh(torch.autograd.Function):
    """The torch 2 style: setup_context, a jvp for forward mode, and a vmap rule generated from both."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, k):
        return torch.tanh(x) * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, k = inputs
        ctx.k = k
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.k * (1 - torch.tanh(x) ** 2), None

    @staticmethod
    def jvp(ctx, dx, _):
        (x,) = ctx.saved_tensors
        return dx * ctx.k * (1 - torch.tanh(x) ** 2)


def _p_custom_function_setup_context_jvp_vmap(device, wrap):
    from torch.func import jacfwd, jacrev, vmap

    x = _randn(3, 4, device=device)
    rev = jacrev(lambda v: _ScaledTanh.apply(v, 2.0))(x[0])
    fwd = jacfwd(lambda v: _ScaledTanh.apply(v, 2.0))(x[0])
    batched = vmap(lambda v: _ScaledTanh.apply(v, 0.5).sum())(x)
    leaf = x.clone().requires_grad_()
    _ScaledTanh.apply(leaf, 3.0).sum().backward()
    return rev, fwd, batched, leaf.grad


def _p_index_reduce_and_scatter_modes(device, wrap):
    x = _randn(5, 3, device=device)
    idx = torch.tensor([0, 2, 0, 4]).to(device)
    src = _randn(4, 3, seed=1, device=device)

    def f(x, idx, src):
        out = {}
        for red in ("prod", "mean", "amax", "amin"):
            out[red] = x.clone().index_reduce_(0, idx, src, red, include_self=red != "mean")
        out["scatter_mul"] = x.clone().scatter_(0, idx[:, None].expand(4, 3), src, reduce="multiply")
        out["scatter_add_mode"] = x.clone().scatter_(0, idx[:, None].expand(4, 3), src, reduce="add")
        out["scatter_value"] = x.clone().scatter_(1, torch.tensor([[2], [0], [1], [1], [0]]).to(x.device), 9.0)
        out["put"] = x.clone().put_(torch.tensor([14, 0, 7]).to(x.device), src[0], accumulate=True)
        out["take"] = x.take(torch.tensor([[0, 14], [3, 3]]).to(x.device))
        out["masked_scatter"] = x.clone().masked_scatter_(x > 0, src.flatten().repeat(2))
        return out

    return wrap(f)(x, idx, src)


def _p_optimizer_state_moves_between_devices(device, wrap):
    model = _mlp(device)
    opt = O.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    step = wrap(_train_step(model, opt, _ce))
    data = _batches(4, device)
    for x, y in data[:2]:
        step(x, y)
    # resume on the CPU from the device's state dicts (moved the way a user moves a CUDA checkpoint)
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, map_location="cpu", weights_only=True)
    cpu_model = _mlp("cpu", seed=3)
    cpu_model.load_state_dict(ck["m"])
    cpu_opt = O.Adam(cpu_model.parameters(), lr=1e-2, amsgrad=True)
    cpu_opt.load_state_dict(ck["o"])
    cpu_step = _train_step(cpu_model, cpu_opt, _ce)
    cpu_losses = [cpu_step(x.cpu(), y.cpu()).item() for x, y in data[2:]]
    losses = [step(x, y).item() for x, y in data[2:]]
    state = cpu_opt.state[next(cpu_model.parameters())]
    return cpu_losses, losses, [p.detach().to(device) for p in cpu_model.parameters()], state["max_exp_avg_sq"].to(
        device), state["step"].device.type


PROGRAMS = {name[3:]: fn for name, fn in dict(globals()).items() if name.startswith("_p_")}
# programs whose inner function is meant for t2j.jit (a train step or a pure function)
JITTABLE = {
    "custom_function_mark_dirty", "func_per_sample_grad_clipping_dp_sgd", "custom_parametrizations_cached_and_removed",
    "spectral_norm_discriminator_training", "pruning_l1_unstructured_training", "clip_grad_value_and_inf_norm_foreach",
    "grad_accumulation_uneven_microbatches", "param_groups_no_decay_and_warmup", "optimizer_zoo_per_group_options",
    "reduce_lr_on_plateau_early_stopping", "swa_with_buffers_and_cyclic_lr", "ema_foreach_lerp_and_bias_correction",
    "custom_optimizer_subclass", "partial_load_strict_false_new_head", "optimizer_state_resume_into_jitted_step",
    "inplace_chains_on_views", "index_ops_on_views", "cumulative_ops_with_dtypes", "einsum_chains_bilinear_attention",
    "fourier_neural_operator_complex_weights", "seeded_training_is_reproducible", "bf16_model_with_fp32_master_weights",
    "autocast_cpu_style_mixed_matmuls", "kv_cache_incremental_decoding", "wavenet_causal_dilated_conv",
    "spatial_transformer_affine_grid", "unfold_fold_patches", "interpolate_upsampling_decoder",
    "rotary_attention_block_sdpa_masks", "mixture_of_experts_topk_routing", "tiny_vae_training",
    "tiny_diffusion_training_step", "simclr_contrastive_loss", "triplet_hard_negative_mining",
    "gcn_message_passing_index_add", "knowledge_distillation_with_temperature", "straight_through_vector_quantizer",
    "dataloader_over_device_tensors", "welford_running_stats_buffers", "dqn_target_network_deepcopy_and_sync",
    "index_reduce_and_scatter_modes", "optimizer_state_moves_between_devices",
}
TOL = {
    "bf16_model_with_fp32_master_weights": dict(atol=1e-2, rtol=1e-2),  # bfloat16 matmuls sum in another order
    "autocast_cpu_style_mixed_matmuls": dict(atol=1e-2, rtol=1e-2),
    "cumulative_ops_with_dtypes": dict(atol=1e-2, rtol=1e-2),
}
# the default run keeps the cheap programs (a few seconds each on 2 cores, most of it compiling each op once);
# `-m slow` runs all
FAST = {
    ("cumulative_ops_with_dtypes", False), ("cumulative_ops_with_dtypes", True), ("func_model_ensembling", False),
    ("module_buffers_apply_and_dtype_round_trip", False), ("unique_inverse_embedding_dedup", False),
    ("pruning_l1_unstructured_training", True), ("custom_parametrizations_cached_and_removed", True),
    ("forward_mode_ad_dual_numbers", False), ("custom_optimizer_subclass", False), ("inplace_chains_on_views", True),
    ("autocast_cpu_style_mixed_matmuls", True), ("clip_grad_value_and_inf_norm_foreach", False),
    ("masks_nonzero_and_boolean_assignment", False), ("reduce_lr_on_plateau_early_stopping", True),
    ("custom_function_materialize_and_double_backward", False), ("optimizer_state_resume_into_jitted_step", False),
    ("rng_state_checkpoint_and_fork", False), ("func_per_sample_grad_clipping_dp_sgd", True),
    ("fuse_conv_bn_for_inference", False), ("index_ops_on_views", True), ("data_assignment_and_requires_grad_toggling",
                                                                         False),
    ("hooks_retain_grad_and_removal", False), ("sparse_adam_rejects_dense_gradients", False),
    ("ema_foreach_lerp_and_bias_correction", True), ("custom_function_mark_dirty", True),
    ("swa_with_buffers_and_cyclic_lr", True), ("dqn_target_network_deepcopy_and_sync", True),
    ("custom_function_setup_context_jvp_vmap", False),
}


def _cases():
    for name in PROGRAMS:
        for jit in (False, True) if name in JITTABLE else (False,):
            marks = [] if (name, jit) in FAST else [pytest.mark.slow]
            yield pytest.param(name, jit, id=f"{name}-{'jit' if jit else 'eager'}", marks=marks)


@pytest.mark.parametrize("name, jit", list(_cases()))
def test_program_matches_torch(name, jit):
    run_program(PROGRAMS, TOL, name, jit)
