"""scan, fori_loop, while_loop, cond, scan_layers and checkpoint against unrolled torch CPU."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest
import torch
import torch.nn as nn

import torch2jax as t2j

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402


def _rnn_pair():
    torch.manual_seed(0)
    cell = nn.Linear(4, 4)
    return cell, copy.deepcopy(cell).to("jax")


def _unrolled(cell, h, xs):
    hs = []
    for x in xs:
        h = torch.tanh(cell(x) + h)
        hs.append(h)
    return h, torch.stack(hs)


def test_scan_values_and_gradients_match_unrolled():
    cell, cj = _rnn_pair()
    xs = torch.randn(5, 2, 4)
    h0 = torch.randn(2, 4, requires_grad=True)
    h, hs = _unrolled(cell, h0, xs)
    (h.sum() + hs.pow(2).sum()).backward()
    h0j = h0.detach().to("jax").requires_grad_(True)
    xsj = xs.to("jax").requires_grad_(True)
    hj, hsj = t2j.scan(lambda h, x: (torch.tanh(cj(x) + h),) * 2, h0j, xsj)
    (hj.sum() + hsj.pow(2).sum()).backward()
    torch.testing.assert_close(hj.detach().cpu(), h.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(hsj.detach().cpu(), hs.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cj.weight.grad.cpu(), cell.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h0j.grad.cpu(), h0.grad, atol=1e-5, rtol=1e-5)


def test_scan_body_runs_in_the_callers_grad_mode_and_its_no_grad_blocks_cut():
    def run(w, xs, scan):
        modes = []

        def body(h, x):
            modes.append(torch.is_grad_enabled())
            with torch.no_grad():
                scale = (h * w).abs().sum() + 1  # a constant for the gradient, as in torch
            h = h * w / scale + x
            return h, h

        h, _ = scan(body, torch.zeros(3, device=xs.device), xs)
        h.sum().backward()
        return h, modes

    def unrolled(body, h, xs):
        for x in xs:
            h, _ = body(h, x)
        return h, None

    g = torch.Generator().manual_seed(0)
    w, xs = torch.randn(3, generator=g).requires_grad_(), torch.randn(4, 3, generator=g)
    wj = w.detach().to("jax").requires_grad_()
    expected, _ = run(w, xs, unrolled)
    got, modes = run(wj, xs.to("jax"), t2j.scan)
    torch.testing.assert_close(got.detach().cpu(), expected.detach())
    torch.testing.assert_close(wj.grad.cpu(), w.grad)
    assert modes and all(modes)


def test_scan_inside_jitted_training_step_matches_torch():
    cell, cj = _rnn_pair()
    xs = torch.randn(5, 2, 4)
    opt, optj = torch.optim.Adam(cell.parameters(), lr=0.01), torch.optim.Adam(cj.parameters(), lr=0.01)

    @t2j.jit
    def step(h0, xs):
        optj.zero_grad()
        _, hs = t2j.scan(lambda h, x: (torch.tanh(cj(x) + h),) * 2, h0, xs)
        loss = hs.pow(2).sum()
        loss.backward()
        optj.step()
        return loss

    for _ in range(4):
        opt.zero_grad()
        expected = _unrolled(cell, torch.zeros(2, 4), xs)[1].pow(2).sum()
        expected.backward()
        opt.step()
        torch.testing.assert_close(step(torch.zeros(2, 4), xs).cpu(), expected.detach(), atol=1e-5, rtol=1e-5)


def test_scan_carries_buffer_updates_and_fresh_dropout():
    counter = torch.zeros((), device="jax")

    def body(c, x):
        counter.add_(1)
        return c + torch.nn.functional.dropout(x, 0.5), c

    c, cs = t2j.scan(body, torch.zeros(64, device="jax"), torch.ones(4, 64, device="jax"))
    assert counter.item() == 4.0
    steps = (cs[1:] - cs[:-1]).cpu()
    assert not torch.equal(steps[0], steps[1])  # a new mask every iteration
    assert set(steps.unique().tolist()) <= {0.0, 2.0}


def test_scan_rejects_carry_shape_change():
    with pytest.raises(RuntimeError, match="carry must keep its shape"):
        t2j.scan(lambda c, x: (torch.cat([c, x]), None), torch.zeros(2, device="jax"), torch.ones(3, 1, device="jax"))


def test_fori_while_and_cond():
    x = torch.ones(3)
    expected = x.clone()
    for i in range(2, 7):
        expected = expected * 0.5 + i
    torch.testing.assert_close(t2j.fori_loop(2, 7, lambda i, x: x * 0.5 + i, x.to("jax")).cpu(), expected)
    assert t2j.while_loop(lambda n: n < 100, lambda n: n * 3, torch.tensor(1, device="jax")).item() == 243

    for sign in (1.0, -1.0):
        xc = (sign * torch.arange(1.0, 4.0)).requires_grad_(True)
        xj = xc.detach().to("jax").requires_grad_(True)
        y = t2j.cond(xj.sum() > 0, lambda v: v * 2, lambda v: v.pow(2), xj)
        (xc * 2 if xc.sum() > 0 else xc.pow(2)).sum().backward()
        y.sum().backward()
        torch.testing.assert_close(xj.grad.cpu(), xc.grad)


def test_cond_inside_jit_uses_traced_predicate():
    f = t2j.jit(lambda x: t2j.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, x))
    assert f(torch.ones(2)).tolist() == [2.0, 2.0]
    assert f(-torch.ones(2)).tolist() == [-2.0, -2.0]
    assert f.stats["traces"] == 1


def _gpt_pair(n_layer=3):
    torch.manual_seed(0)
    ref = gpt.GPT(gpt.GPTConfig(n_layer=n_layer, n_embd=32, n_head=4, block_size=16))
    return ref, copy.deepcopy(ref).to("jax")


def _forward_scanned(model, idx, remat=None):
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=idx.device))
    x = t2j.scan_layers(model.blocks, x, remat=remat)
    return model.head(model.ln_f(x))


@pytest.mark.parametrize("remat", [None, True, jax.checkpoint_policies.dots_saveable])
def test_scan_layers_matches_unrolled_values_and_every_layers_gradients(remat):
    ref, model = _gpt_pair()
    ids = torch.randint(0, 96, (2, 16))
    out = _forward_scanned(model, ids.to("jax"), remat)
    expected = ref(ids)
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-6, rtol=1e-4, msg=n)


@pytest.mark.slow  # ~15 s; test_mark_sharding_inside_scan_layers_on_an_8_device_mesh trains scan_layers in CI
def test_scan_layers_training_under_jit_matches_unrolled():
    ref, model = _gpt_pair()
    opt, optj = torch.optim.AdamW(ref.parameters(), lr=1e-3), torch.optim.AdamW(model.parameters(), lr=1e-3)

    @t2j.jit
    def step(ids, targets):
        optj.zero_grad()
        logits = _forward_scanned(model, ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optj.step()
        return loss

    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids, targets = torch.randint(0, 96, (2, 16), generator=g), torch.randint(0, 96, (2, 16), generator=g)
        opt.zero_grad()
        _, expected = ref(ids, targets)
        expected.backward()
        opt.step()
        torch.testing.assert_close(step(ids, targets).cpu(), expected.detach(), atol=1e-5, rtol=1e-5)


def test_scan_layers_body_multiplies_by_linear_weights_without_transposing_them():
    torch.manual_seed(0)
    ref = nn.ModuleList(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4)) for _ in range(3))
    layers = copy.deepcopy(ref).to("jax")
    x = torch.randn(5, 4)
    forward = t2j.jit(lambda x: t2j.scan_layers(layers, x))
    h = x
    for layer in ref:
        h = layer(h)
    with torch.no_grad():
        torch.testing.assert_close(forward(x.to("jax")).cpu(), h.detach(), atol=1e-6, rtol=1e-5)
        # Linear's weight.t() becomes the dot's contracting dimension (XLA:CPU copies a
        # transpose in a loop body on every iteration)
        assert "stablehlo.transpose" not in forward.lower(x.to("jax")).as_text()


def test_scan_layers_batchnorm_buffers_written_per_layer():
    torch.manual_seed(0)
    ref = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(3))
    layers = copy.deepcopy(ref).to("jax")
    x = torch.randn(8, 4)
    h = x
    for layer in ref:
        h = layer(h)
    out = t2j.scan_layers(layers, x.to("jax"))
    torch.testing.assert_close(out.cpu(), h.detach(), atol=1e-5, rtol=1e-5)
    for (n, b), r in zip(layers.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b.cpu(), r, atol=1e-6, rtol=1e-5, msg=n)


def test_scan_layers_rejects_different_layers():
    layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 8)]).to("jax")
    with pytest.raises(RuntimeError, match="same shapes"):
        t2j.scan_layers(layers, torch.ones(1, 4, device="jax"))


def test_checkpoint_values_and_gradients():
    cell, cj = _rnn_pair()
    x = torch.randn(3, 4, requires_grad=True)
    xj = x.detach().to("jax").requires_grad_(True)
    block = t2j.checkpoint(lambda v: torch.tanh(cj(v)).pow(2), policy=jax.checkpoint_policies.nothing_saveable)
    block(xj).sum().backward()
    torch.tanh(cell(x)).pow(2).sum().backward()
    torch.testing.assert_close(xj.grad.cpu(), x.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cj.weight.grad.cpu(), cell.weight.grad, atol=1e-6, rtol=1e-5)


def _hf(name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0,
                                  embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.slow  # (test_layer_scan's HF Llama runs with its KV cache stay in CI)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_use_scan_layers_on_hf_models(name):
    ref = _hf(name)
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    ids = torch.randint(0, 128, (2, 16))
    out = model(ids.to("jax"), labels=ids.to("jax"), use_cache=False)
    expected = ref(ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.logits.detach().cpu(), expected.logits.detach(), atol=1e-5, rtol=1e-5)
    out.loss.backward()
    expected.loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-6, rtol=1e-4, msg=n)
    assert list(model.state_dict()) == list(ref.state_dict())
    # generation with a KV cache runs the layers one by one and matches torch token for token
    prompt = ids[:1, :4]
    generated = model.generate(prompt.to("jax"), max_new_tokens=6, do_sample=False)
    assert generated.cpu().tolist() == ref.generate(prompt, max_new_tokens=6, do_sample=False).tolist()


@pytest.mark.parametrize("stack", [False, True], ids=["per_layer", "stacked"])
def test_converted_layer_list_runs_through_scan_layers_and_loops(stack):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)])
    h = torch.randn(2, 8)
    expected = h
    for block in blocks:
        expected = block(expected)
    for device in ("jax", "cpu"):
        holder = torch.nn.Module()
        holder.blocks = copy.deepcopy(blocks).to(device)
        t2j.use_scan_layers(holder, names=("blocks",), stack_parameters=stack)
        looped = h.to(device)
        for block in holder.blocks:  # one scan on the jax device; the layers one by one on the CPU
            looped = block(looped)
        torch.testing.assert_close(looped.cpu(), expected)
        if device == "jax":
            torch.testing.assert_close(t2j.scan_layers(holder.blocks, h.to("jax")).cpu(), expected)


# (slow: test_converted_layer_list_runs_through_scan_layers_and_loops covers the stacked path by default)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_use_scan_layers_with_stacked_parameters(name):
    ref = _hf(name)
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"), stack_parameters=True)
    layers = model.model.layers if name == "llama" else model.transformer.h
    per_layer = len(list(ref.parameters())) - len(list(model.parameters()))
    assert per_layer == (len(layers) - 1) * len(layers._t2j_stacked)
    # checkpoints keep the per-layer names and values
    state = model.state_dict()
    assert sorted(state) == sorted(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k].cpu(), v, msg=k)
    layer_param = "self_attn.q_proj.weight" if name == "llama" else "attn.c_attn.weight"
    torch.testing.assert_close(layers[1].get_submodule(layer_param.rsplit(".", 1)[0]).weight.cpu(),
                               dict(ref.named_parameters())[f"{'model.layers' if name == 'llama' else 'transformer.h'}"
                                                            f".1.{layer_param}"].detach())
    ids = torch.randint(0, 128, (2, 16))
    out = model(ids.to("jax"), labels=ids.to("jax"), use_cache=False)
    expected = ref(ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.logits.detach().cpu(), expected.logits.detach(), atol=1e-5, rtol=1e-5)
    out.loss.backward()
    expected.loss.backward()
    prefix = "model.layers" if name == "llama" else "transformer.h"
    ref_params = dict(ref.named_parameters())
    for n, key in layers._t2j_stacked.items():
        want = torch.stack([ref_params[f"{prefix}.{k}.{n}"].grad for k in range(len(layers))])
        torch.testing.assert_close(layers._parameters[key].grad.cpu(), want, atol=1e-6, rtol=1e-4, msg=n)
    # trains under t2j.jit like the unstacked model
    model.zero_grad()
    ref.zero_grad()
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def step(m, o, ids):
        o.zero_grad()
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        o.step()
        return loss

    jitted = t2j.jit(step)
    for _ in range(3):
        torch.testing.assert_close(jitted(model, opt, ids.to("jax")).cpu(), step(ref, ref_opt, ids),
                                   atol=2e-5, rtol=2e-4)
    # a fresh stacked model loads the per-layer checkpoint, and generates with a KV cache
    fresh = t2j.use_scan_layers(_hf(name).to("jax"), stack_parameters=True)
    fresh.load_state_dict(ref.state_dict())
    prompt = ids[:1, :4]
    generated = fresh.generate(prompt.to("jax"), max_new_tokens=5, do_sample=False)
    assert generated.cpu().tolist() == ref.generate(prompt, max_new_tokens=5, do_sample=False).tolist()


def test_torch_higher_order_ops_on_the_jax_device():
    from torch._higher_order_ops import scan as torch_scan
    from torch._higher_order_ops import while_loop as torch_while_loop

    x = torch.tensor([1.0, -2.0, 3.0])
    out = torch.cond(x.to("jax").sum() > 0, lambda v: v * 2, lambda v: -v, (x.to("jax"),))
    assert out.device.type == "jax" and out.tolist() == [2.0, -4.0, 6.0]
    i, v = torch_while_loop(lambda i, v: i < 5, lambda i, v: (i + 1, v * 2),
                            (torch.tensor(0, device="jax"), torch.ones(2, device="jax")))
    assert i.item() == 5 and v.tolist() == [32.0, 32.0]
    c, ys = torch_scan(lambda c, x: (c + x, c * 1), torch.zeros(2, device="jax"), torch.ones(3, 2, device="jax"))
    assert c.tolist() == [3.0, 3.0] and ys[:, 0].tolist() == [0.0, 1.0, 2.0]
    # CPU inputs keep torch's own behaviour
    assert torch.cond(torch.tensor(True), lambda v: v * 2, lambda v: -v, (torch.ones(2),)).tolist() == [2.0, 2.0]


def test_torch_dynamo_imported_during_a_trace_still_compiles_on_the_cpu():
    # a trace replaces builtins.len / min / max; dynamo imported for the first time under them used to
    # keep ours as the builtins it knows, and torch.cond on CPU tensors failed afterwards
    code = textwrap.dedent("""
        import sys, torch, torch2jax as t2j
        assert "torch._dynamo" not in sys.modules

        def f(x):
            import torch._dynamo  # noqa: F401
            return x * 2

        t2j.jit(f)(torch.ones(2, device="jax"))
        print(torch.cond(torch.tensor(True), lambda v: v * 2, lambda v: -v, (torch.ones(2),)).tolist())
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[2.0, 2.0]"


def _barriers(jitted, *args):
    return jitted.lower(*args).as_text().count("optimization_barrier")


def test_torch_utils_checkpoint_is_remat_under_jit():
    cell, cj = _rnn_pair()
    x = torch.randn(3, 4, requires_grad=True)

    def loss(cell, x):
        return torch.utils.checkpoint.checkpoint(lambda v: torch.tanh(cell(v)).pow(2), x, use_reentrant=False).sum()

    expected = loss(cell, x)
    expected.backward()

    @t2j.jit
    def step(x):
        cj.zero_grad()
        out = loss(cj, x)
        out.backward()
        return out

    xj = x.detach().to("jax")
    torch.testing.assert_close(step(xj).cpu(), expected.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cj.weight.grad.cpu(), cell.weight.grad, atol=1e-6, rtol=1e-5)
    # jax.checkpoint's backward recomputes behind an optimization barrier; torch's own
    # recompute would be ops that XLA merges with the forward
    assert _barriers(step, xj) == 1
    # CPU inputs keep torch's checkpoint
    assert torch.utils.checkpoint.checkpoint(lambda v: v * 2, torch.ones(2), use_reentrant=False).tolist() == [2, 2]


class _CountingBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # (torch's recompute in the backward pass counts again)
        return torch.tanh(self.lin(x)) * self.calls


def test_a_checkpointed_block_that_changes_python_state_under_jit_matches_torch():
    # jax.checkpoint cannot carry ``self.calls`` out of its trace: torch's own checkpoint runs in the
    # program instead, whose recompute repeats the change, as in torch
    def run(device, wrap):
        torch.manual_seed(0)
        block = _CountingBlock().to(device)
        opt = torch.optim.SGD(block.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            loss = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum()
            loss.backward()
            opt.step()
            return loss

        fn = wrap(step)
        losses = [fn(torch.ones(2, 4, device=device)).item() for _ in range(3)]
        return losses, block.calls, getattr(fn, "stats", {}).get("eager_calls", 0)

    expected, got = run("cpu", lambda f: f), run("jax", t2j.jit)
    assert got[1:] == (expected[1], 0) == (6, 0)
    assert got[0] == pytest.approx(expected[0], rel=1e-5)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("scanned", [False, True])
def test_hf_gradient_checkpointing_under_jit_matches_torch(scanned):
    ref = _hf("llama")
    ref.train()
    model = copy.deepcopy(ref).to("jax")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if scanned:
        t2j.use_scan_layers(model)
    ids = torch.randint(0, 128, (2, 16))
    expected = ref(ids, labels=ids, use_cache=False).loss
    expected.backward()

    @t2j.jit
    def step(ids):
        model.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    idsj = ids.to("jax")
    torch.testing.assert_close(step(idsj).cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-6, rtol=1e-4, msg=n)
    # one remat per layer unrolled; one for the scanned layer body
    assert _barriers(step, idsj) == (1 if scanned else 3)


def test_mark_sharding_inside_scan_layers_on_an_8_device_mesh():
    # the device count is fixed when JAX starts: run in a fresh process with 8 virtual CPU devices
    code = textwrap.dedent("""
        import copy, json
        import torch, torch.nn as nn
        import torch2jax as t2j
        P = t2j.parallel

        class Layer(nn.Module):
            def __init__(self, mesh):
                super().__init__()
                self.lin, self.mesh = nn.Linear(16, 16), mesh

            def forward(self, h):
                h = torch.tanh(self.lin(h))
                return P.mark_sharding(h, self.mesh, ("data", "model")) if self.mesh is not None else h

        mesh = P.make_mesh({"data": 4, "model": 2})
        torch.manual_seed(0)
        ref = nn.ModuleList(Layer(None) for _ in range(3))
        layers = copy.deepcopy(ref).to("jax")
        for layer in layers:
            layer.mesh = mesh
        x = torch.randn(8, 16)
        h = x
        for layer in ref:
            h = layer(h)
        h.pow(2).sum().backward()

        @t2j.jit
        def step(x):
            layers.zero_grad()
            out = t2j.scan_layers(layers, x)
            out.pow(2).sum().backward()
            return out

        xj = P.shard_batch(x, mesh, "data")
        out = step(xj)
        text = step.lower(xj).as_text()
        loop = text[text.index("stablehlo.while"):]
        print(json.dumps({
            "out": (out.cpu() - h).abs().max().item(),
            "grad": max((p.grad.cpu() - q.grad).abs().max().item() for p, q in zip(layers.parameters(), ref.parameters())),
            "in_loop": loop.count("sdy.sharding_constraint") + loop.count("@Sharding"),
            "spec": str(P.sharding_of(out).spec),
        }))
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["out"] < 1e-5 and r["grad"] < 1e-5
    # the constraint is in the loop body (forward and the backward's transposed constraint)
    assert r["in_loop"] >= 1
    assert r["spec"] == "P('data', 'model')"


def test_call_jax_kernel_inside_a_scanned_body_matches_unrolled():
    torch.manual_seed(0)
    xs, w0 = torch.randn(4, 3), torch.randn(3, 3)

    def body(w):
        def step(h, xi):
            h = t2j.call_jax(lambda a, b: jax.numpy.tanh(a @ b), h, w) + xi
            return h, h.sum()
        return step

    results = []
    for scanned in (True, False):
        x = xs.to("jax").requires_grad_()
        w = w0.to("jax").requires_grad_()
        h = torch.zeros(3, device="jax")
        if scanned:
            h, ys = t2j.scan(body(w), h, x)
        else:
            outs = []
            for i in range(4):
                h, y = body(w)(h, x[i])
                outs.append(y)
            ys = torch.stack(outs)
        (h.sum() + ys.sum()).backward()
        results.append([h.detach().cpu(), ys.detach().cpu(), w.grad.cpu(), x.grad.cpu()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_scanned_body_writing_a_closed_over_tensor_carries_it():
    counter = torch.zeros((), device="jax")
    total = torch.zeros(3, device="jax")

    def body(h, xi):
        counter.add_(1)
        total.add_(xi * counter)
        return h + xi, h

    xs = torch.arange(12.0).reshape(4, 3)
    t2j.scan(body, torch.zeros(3, device="jax"), xs.to("jax"))
    expected = sum(xs[i] * (i + 1) for i in range(4))
    assert counter.item() == 4
    torch.testing.assert_close(total.cpu(), expected)


def test_checkpoint_complex_gradient_in_torch_convention():
    z_cpu = torch.tensor([1 + 2j, 3 - 1j], requires_grad=True)
    z = z_cpu.detach().to("jax").requires_grad_()

    def f(v):
        return (v.abs() ** 2 * torch.tensor([1.0, 2.0], device=v.device) + v.real).sum()

    f(z_cpu).backward()
    t2j.checkpoint(f)(z).backward()
    torch.testing.assert_close(z.grad.cpu(), z_cpu.grad)


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


@pytest.mark.parametrize("how", ["scan", "fori_loop", "cond", "checkpoint"])
@pytest.mark.parametrize("jitted", [False, True])
def test_state_a_body_can_reach_but_does_not_use_gets_no_gradient(how, jitted):
    # torch leaves .grad None for a parameter no output depends on, and AdamW then leaves it alone
    torch.manual_seed(0)
    model = _TwoLayers().to("jax")
    unused_before = model.unused.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    x = torch.randn(3, 4, device="jax")
    bodies = {
        "scan": lambda: t2j.scan(lambda c, xt: (model.used(c + xt), c.sum()), torch.zeros(4, device="jax"), x)[0],
        "fori_loop": lambda: t2j.fori_loop(0, 2, lambda i, c: model.used(c), x),
        "cond": lambda: t2j.cond(x.sum() > 0, lambda v: model.used(v), lambda v: model.used(v) * 2, x),
        "checkpoint": lambda: t2j.checkpoint(lambda v: model.used(v))(x),
    }

    def step():
        opt.zero_grad()
        bodies[how]().sum().backward()
        opt.step()

    for _ in range(2):
        (t2j.jit(step) if jitted else step)()
    assert model.unused.weight.grad is None and model.used.weight.grad is not None
    assert model.unused.weight not in opt.state
    assert torch.equal(model.unused.weight.detach().cpu(), unused_before.cpu())


def _programs_on_either_device(x, layers):
    """Every construct, for a model that runs on the CPU and on the jax device alike."""
    c, ys = t2j.scan(lambda c, xi: (c * 0.5 + xi.sin(), c * 2), torch.zeros_like(x[0]), x)
    back, _ = t2j.scan(lambda c, xi: (c + xi, None), x[0], x, reverse=True)
    i_loop = t2j.fori_loop(0, 3, lambda i, v: v * 2 + i, x[1])
    w_loop = t2j.while_loop(lambda v: v.sum() < 50, lambda v: v * 2 + 1, x[2].detach().abs())
    branch = t2j.cond(x.sum() > 0, lambda v: v.exp(), lambda v: -v, x[3])
    remat = t2j.checkpoint(lambda v: (v.tanh() * 3).cos())(x)
    h = t2j.scan_layers(layers, x)
    return [c, ys, back, i_loop, w_loop, branch, remat, h]


def test_control_flow_on_cpu_tensors_runs_as_torch_code():
    # (the results stay on the CPU and torch's backward runs; they jumped to the jax device and the
    # backward crashed in torch's engine)
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])
    jax_layers = copy.deepcopy(layers).to("jax")
    x = torch.randn(4, 3, requires_grad=True)
    xj = x.detach().to("jax").requires_grad_()
    got, expected = _programs_on_either_device(xj, jax_layers), _programs_on_either_device(x, layers)
    for g, e in zip(got, expected):
        assert e.device.type == "cpu"
        torch.testing.assert_close(g.detach().cpu(), e.detach(), rtol=1e-5, atol=1e-6)
    sum(t.sum() for t in got if t.requires_grad).backward()
    sum(t.sum() for t in expected if t.requires_grad).backward()
    torch.testing.assert_close(xj.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
    for p, q in zip(jax_layers.parameters(), layers.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5)
