"""Scanned layer stacks whose layers differ: attributes, patterns, per-layer arguments (torch CPU is the oracle)."""

import collections
import functools
import types
import copy
import warnings

import pytest
import torch
from torch import nn

import torch2jax as t2j


RUNS = collections.Counter()  # Block.forward calls, by kind: a scan runs a layer's forward once for all


class Block(nn.Module):
    """A layer whose forward depends on a Python attribute (``kind``) and optionally on its index."""

    def __init__(self, kind="a", index=0, reads_index=False, norm=False, width=8):
        super().__init__()
        self.lin = nn.Linear(width, 8)
        self.norm = nn.BatchNorm1d(8) if norm else None
        self.kind, self.index, self.reads_index = kind, index, reads_index

    def forward(self, x, scale=None):
        RUNS[self.kind] += 1
        h = torch.tanh(self.lin(x))
        if self.norm is not None:
            h = self.norm(h)
        if self.kind == "b":
            h = h * 2
        if self.reads_index:
            h = h + self.index
        if scale is not None:
            h = h * scale
        return h + x[..., :8]


class Stack(nn.Module):
    def __init__(self, kinds, **kw):
        super().__init__()
        self.layers = nn.ModuleList([Block(kind, i, **kw) for i, kind in enumerate(kinds)])

    def forward(self, x, scales=None, stop=None):
        for i, layer in enumerate(self.layers):
            if i == stop:
                break
            x = layer(x, None if scales is None else scales[i])
        return x


def _pair(kinds, **kw):
    torch.manual_seed(0)
    ref = Stack(kinds, **kw)
    return ref, t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))


def _runs(fn, *args, **kwargs):
    """How many times ``fn`` runs a layer's forward (eagerly on the jax device)."""
    RUNS.clear()
    fn(*args, **kwargs)
    return sum(RUNS.values())


def _check(ref, model, x, **kw):
    expected = ref(x, **kw)
    got = model(x.to("jax"), **{k: v.to("jax") if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    torch.testing.assert_close(got.cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    return got, expected


def test_alternating_layers_scan_a_period_at_a_time():
    ref, model = _pair(["a", "b"] * 3)
    x = torch.randn(2, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, expected = _check(ref, model, x)
    got.sum().backward()
    expected.sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-4, msg=n)
    assert _runs(model, x.detach().to("jax")) == 4  # layers 0 and 1 as they are, then one of each kind
    # explicit scan_layers takes the same pattern
    h = t2j.scan_layers(model.layers, x.detach().to("jax"))
    torch.testing.assert_close(h.cpu(), ref(x).detach(), atol=1e-5, rtol=1e-5)


def test_scanned_layers_of_a_functionalized_module_under_jax_grad():
    # functional_call swaps plain tensors in for the parameters, which get_parameter refused
    import jax
    import numpy as np

    ref, model = _pair(["a", "b"] * 3, norm=True)
    fn, state = t2j.functionalize(model)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)

    def loss(params):
        out, new = fn.apply({"params": params, "buffers": state["buffers"]}, x)
        return (out ** 2).sum(), new

    (value, new), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state["params"])
    expected = (ref(torch.from_numpy(x)) ** 2).sum()
    expected.backward()
    np.testing.assert_allclose(value, expected.item(), rtol=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(grads[n], p.grad.numpy(), atol=1e-3, rtol=1e-4, err_msg=n)
    for n, b in ref.named_buffers():
        np.testing.assert_allclose(new["buffers"][n], b.numpy(), atol=1e-6, err_msg=n)


def test_a_forward_reading_an_attribute_that_differs_in_every_layer_runs_the_layers_one_by_one():
    ref, model = _pair(["a"] * 4, reads_index=True)
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"reads ``index``, which differs from layer to layer"):
        _check(ref, model, x)
    assert ("", "index") in model.layers._t2j_read
    _check(ref, model, x)  # (known now: no trace is attempted)
    assert _runs(model, x.to("jax")) == 4
    # an index the forward does not read does not stop the scan
    ref, model = _pair(["a"] * 4)
    _check(ref, model, x)
    assert _runs(model, x.to("jax")) == 1


def test_per_layer_arguments_are_each_layers_own():
    # the scan starts with layer 0's arguments; layer 1 gets another scale, so the rest runs as called,
    # and the BatchNorm statistics the scan wrote for layers 1.. are put back first
    ref, model = _pair(["a"] * 4, norm=True)
    x = torch.randn(6, 8)
    scales = torch.tensor([1.0, 2.0, 3.0, 4.0])
    with pytest.warns(UserWarning, match="called layer 1 with other arguments than layer 0"):
        _check(ref, model, x, scales=list(scales))
    for k, (a, b) in enumerate(zip(model.layers, ref.layers)):
        torch.testing.assert_close(a.norm.running_mean.cpu(), b.norm.running_mean, msg=f"layer {k}")
        assert a.norm.num_batches_tracked.item() == b.norm.num_batches_tracked.item() == 1
    # arguments that repeat with the layers' pattern are scanned a period at a time
    ref, model = _pair(["a", "b"] * 3)
    per_kind = {"a": torch.tensor(0.5), "b": torch.tensor(-1.5)}
    scales = [per_kind[layer.kind] for layer in ref.layers]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(ref, model, x, scales=scales)
    assert _runs(model, x.to("jax"), scales=[s.to("jax") for s in scales[:2]] * 3) == 4


def test_a_loop_that_stops_early_leaves_the_later_layers_buffers():
    ref, model = _pair(["a"] * 5, norm=True)
    x = torch.randn(6, 8)
    _check(ref, model, x, stop=2)
    for a, b in zip(model.layers, ref.layers):
        torch.testing.assert_close(a.norm.running_var.cpu(), b.norm.running_var)
        assert a.norm.num_batches_tracked.item() == b.norm.num_batches_tracked.item()


def test_layers_that_differ_in_structure_scan_the_part_that_repeats():
    torch.manual_seed(0)
    ref = Stack(["a"] * 5)
    ref.layers[0] = Block(width=8)
    ref.layers[0].extra = nn.Parameter(torch.ones(8))  # a first layer unlike the others (DeepSeek's dense layers)
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    x = torch.randn(2, 8)
    _check(ref, model, x)
    assert _runs(model, x.to("jax")) == 2
    with pytest.raises(t2j.control_flow.ControlFlowError, match="stack_parameters needs layers of one structure"):
        t2j.use_scan_layers(copy.deepcopy(ref), stack_parameters=True)
    # no run of layers repeats: nothing to scan, said at conversion
    odd = Stack(["a", "a"])
    odd.layers[1] = Block(width=8)
    odd.layers[1].lin = nn.Linear(8, 8, bias=False)
    with pytest.raises(t2j.control_flow.ControlFlowError, match=r"layers: no two neighbouring layers are alike and "
                                                                 r"no pattern of them repeats \(layer 1: "
                                                                 r"it has 1 parameters, layer 0 has 2\)"):
        t2j.use_scan_layers(odd)


@pytest.mark.parametrize("periods,runs", [(1, 2), (2, 4), (4, 6)])
def test_runs_of_alike_layers_that_another_layer_ends_are_scanned(periods, runs):
    # Gemma 3's pattern: three (five) sliding-window layers, then a full-attention one. With one or two
    # periods, each run of three scans on its own; from the second period of four on, once every kind's
    # arguments were seen, the rest scans a period at a time
    ref, model = _pair(["a", "a", "a", "b"] * periods, norm=True)
    x = torch.randn(6, 8, requires_grad=True)
    per_kind = {"a": torch.tensor(0.5), "b": torch.tensor(-1.5)}
    scales = [per_kind[layer.kind] for layer in ref.layers]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, expected = _check(ref, model, x, scales=scales)
    w = torch.randn(6, 8)  # (not a plain sum: through training-mode BatchNorm its gradient is zero)
    (got * w.to("jax")).sum().backward()
    (expected * w).sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-4, rtol=1e-4, msg=n)
    for k, (a, b) in enumerate(zip(model.layers, ref.layers)):
        torch.testing.assert_close(a.norm.running_mean.cpu(), b.norm.running_mean, msg=f"layer {k}")
    jax_kind = {kind: s.to("jax") for kind, s in per_kind.items()}
    jax_scales = [jax_kind[layer.kind] for layer in ref.layers]
    assert _runs(model, x.detach().to("jax"), scales=jax_scales) == runs
    # a run at the end of the list scans too (a trailing "a a" after the last full layer)
    ref, model = _pair(["a", "a", "b", "a", "a"])
    _check(ref, model, x.detach())
    assert _runs(model, x.detach().to("jax")) == 3


def test_the_loop_sees_each_layer_as_itself():
    _, model = _pair(["a", "b"])
    seen = [(isinstance(layer, Block), layer.kind) for layer in model.layers]
    assert seen == [(True, "a"), (True, "b")]
    assert [layer.kind for layer in model.layers[1:]] == ["b"]
    assert isinstance(model.layers[0], Block)


@pytest.mark.slow  # (use_scan_layers on whole HF models: the Llama runs stay in CI)
def test_hf_gemma2_alternating_sliding_and_full_attention_matches_torch():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4)
    ref = transformers.Gemma2ForCausalLM(cfg)
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    ids = torch.randint(0, 128, (2, 12))  # longer than the window: sliding and full attention differ
    out = model(ids.to("jax"), labels=ids.to("jax"), use_cache=False)
    expected = ref(ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.logits.detach().cpu(), expected.logits.detach(), atol=1e-5, rtol=1e-5)
    out.loss.backward()
    expected.loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-6, rtol=1e-4, msg=n)
    calls = collections.Counter()
    forward = transformers.models.gemma2.modeling_gemma2.Gemma2DecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls[self.self_attn.sliding_window] += 1
        return forward(self, *args, **kwargs)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.models.gemma2.modeling_gemma2.Gemma2DecoderLayer, "forward", counted)
        model(ids.to("jax"), use_cache=False)
    assert calls == {4: 2, None: 2}  # layers 0 and 1 as they are, then one body for layers 2..5


class _Shifted(nn.Module):
    shift = 0.0  # a class default under the per-layer value

    def __init__(self, shift):
        super().__init__()
        self.lin, self.shift, self.scale, self.aux = nn.Linear(8, 8), shift, 1.0, None

    def forward(self, x, ctx=None):
        h = torch.tanh(self.lin(x)) * self.scale * (1.0 if ctx is None else ctx.scale)
        return x + h


class _Loop(nn.Module):
    """Layers called by a loop that does more than chain them (each case a way the scan's assumptions break)."""

    def __init__(self, case, n=4):
        super().__init__()
        self.case = case
        self.layers = nn.ModuleList([_Shifted(float(i) if case == "class_default" else 0.0) for i in range(n)])

    def forward(self, x):
        ctx = types.SimpleNamespace(scale=1.0)
        for i, layer in enumerate(self.layers):
            if self.case == "class_default":
                x = layer(x) + layer.shift
            elif self.case == "mutated_argument":  # one object passed to every layer, changed in between
                ctx.scale = float(i + 1)
                x = layer(x, ctx)
            elif self.case == "attribute_set_by_the_loop":
                layer.scale = 1.0 if i == 0 else 0.5
                x = layer(x)
            elif self.case == "transformed_between_layers":
                x = torch.tanh(layer(x))
            elif self.case == "reversed":
                pass
        if self.case == "reversed":
            for layer in self.layers[::-1]:
                x = layer(x)
        return x


@pytest.mark.slow  # ~10 s; test_gradcut.py::test_custom_function_inside_a_jax_transform_under_t2j_jit runs in CI
def test_hf_bloom_with_its_custom_gelu_function_trains_under_jit():
    """Bloom's GELU is a custom autograd.Function: inside the scanned layers of a jitted step."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    ref = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=4, n_head=4))
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    ids = torch.randint(0, 128, (2, 10))

    @t2j.jit
    def step(i):
        out = model(i, labels=i, use_cache=False)
        out.loss.backward()
        return out.loss

    loss = step(ids.to("jax"))
    expected = ref(ids, labels=ids, use_cache=False).loss
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-6, rtol=1e-4, msg=n)


@pytest.mark.parametrize("case", ["class_default", "mutated_argument", "attribute_set_by_the_loop",
                                  "transformed_between_layers", "reversed"])
def test_loops_that_break_the_scans_assumptions_match_torch(case):
    torch.manual_seed(0)
    ref = _Loop(case)
    x = torch.randn(2, 8)
    for stack in ([False, True] if case == "reversed" else [False]):
        model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"), stack_parameters=stack)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (each case says why the layers ran one by one)
            torch.testing.assert_close(model(x.to("jax")).cpu(), ref(x).detach(), atol=1e-5, rtol=1e-5)


def test_a_layer_the_loop_skips_keeps_its_buffers():
    ref, model = _pair(["a"] * 4, norm=True)
    x = torch.randn(6, 8)

    def skip_one(stack, x):
        for i, layer in enumerate(stack.layers):
            if i != 1:  # (LayerDrop)
                x = layer(x)
        return x

    with pytest.warns(UserWarning, match="discarded"):
        torch.testing.assert_close(skip_one(model, x.to("jax")).cpu(), skip_one(ref, x).detach(), atol=1e-5,
                                   rtol=1e-5)
    for a, b in zip(model.layers, ref.layers):
        torch.testing.assert_close(a.norm.running_mean.cpu(), b.norm.running_mean)
        assert a.norm.num_batches_tracked.item() == b.norm.num_batches_tracked.item()


def test_hooks_and_stores_of_each_layer_happen_per_layer():
    torch.manual_seed(0)
    ref = Stack(["a"] * 4)
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    seen, expected = [], []
    for layer in model.layers:  # one function on every layer, recording each layer's output
        layer.register_forward_hook(lambda m, args, out: seen.append(out.detach().cpu()))
    for layer in ref.layers:
        layer.register_forward_hook(lambda m, args, out: expected.append(out.detach()))
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x.to("jax")).cpu(), ref(x).detach(), atol=1e-5, rtol=1e-5)
    assert len(seen) == len(expected) == 4
    for a, b in zip(seen, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # a forward that stores a value in its layer (an MoE auxiliary loss) runs per layer, with a warning
    torch.manual_seed(0)
    ref = _Chain([_Storing() for _ in range(4)])
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    with pytest.warns(UserWarning, match="stores a value in ``aux``"):
        torch.testing.assert_close(model(x.to("jax")).cpu(), ref(x).detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(model.layers, ref.layers):
        torch.testing.assert_close(a.aux.detach().cpu(), b.aux.detach(), atol=1e-6, rtol=1e-5)


class _Storing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.aux = nn.Linear(8, 8), None

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        self.aux = h.square().mean()
        return x + h


class _Chain(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_stacking_refuses_layers_frozen_unlike_the_others_and_ties_within_a_layer_scan():
    torch.manual_seed(0)
    ref = Stack(["a"] * 4)
    ref.layers[0].requires_grad_(False)
    with pytest.raises(t2j.control_flow.ControlFlowError, match="some of layers's layers are frozen"):
        t2j.use_scan_layers(copy.deepcopy(ref), stack_parameters=True)
    ref = Stack(["a"] * 4, width=8)
    for layer in ref.layers:  # a parameter under two names in each layer
        layer.tied = nn.Linear(8, 8)
        layer.tied.weight = layer.lin.weight
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    x = torch.randn(2, 8)
    _check(ref, model, x)
    assert _runs(model, x.to("jax")) == 1


@pytest.mark.slow  # (use_scan_layers on whole HF models: the Llama runs stay in CI)
def test_hf_hybrid_of_convolution_and_attention_layers_matches_torch():
    # LFM2's conv layers hold conv.layer_idx, its attention layers self_attn.layer_idx: each differs in every
    # layer that has it (the list was refused: no period)
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.Lfm2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                  layer_types=["conv", "full_attention"] * 3)
    ref = transformers.Lfm2ForCausalLM(cfg).eval()
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    ids = torch.randint(0, 128, (2, 10))
    torch.testing.assert_close(model(ids.to("jax"), use_cache=False).logits.detach().cpu(),
                               ref(ids, use_cache=False).logits.detach(), atol=1e-5, rtol=1e-5)


def _counting_layer_calls(monkeypatch, cls):
    """Counts the calls of ``cls.forward`` given the real KV cache (not the scan's stand-in)."""
    calls = collections.Counter()
    forward = cls.forward

    def counted(self, *args, **kwargs):
        calls["n"] += isinstance(kwargs.get("cache"), transformers_cache())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", counted)
    return calls


def transformers_cache():
    import transformers

    return transformers.Cache


def _assert_same_cache(cache, expected):
    assert [type(a) for a in cache.layers] == [type(b) for b in expected.layers]
    for a, b in zip(cache.layers, expected.layers):
        torch.testing.assert_close(a.keys.cpu(), b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values.cpu(), b.values, atol=1e-5, rtol=1e-5)
        def plain(layer):
            return {k: v for k, v in vars(layer).items() if not isinstance(v, torch.Tensor) and k != "device"}

        assert plain(a) == plain(b)


@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma2", marks=pytest.mark.slow),
                                  pytest.param("gemma3", marks=pytest.mark.slow)])
def test_hf_default_call_with_its_kv_cache_scans_and_fills_the_cache(arch, monkeypatch):
    """``model(ids, labels=ids)`` makes a DynamicCache (use_cache defaults to True): the scan stands
    in for it, and the cache ends as torch's (Gemma 2: sliding and full cache layers in turn)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2)
        ref, layer_cls = transformers.LlamaForCausalLM(cfg), transformers.models.llama.modeling_llama.LlamaDecoderLayer
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4)
        ref = transformers.Gemma2ForCausalLM(cfg)
        layer_cls = transformers.models.gemma2.modeling_gemma2.Gemma2DecoderLayer
    else:
        # five sliding-window layers, a full-attention one, two sliding: two runs scan, one layer as it is
        cfg = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                            sliding_window=4)
        ref = transformers.Gemma3ForCausalLM(cfg)
        layer_cls = transformers.models.gemma3.modeling_gemma3.Gemma3DecoderLayer
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    ids, nxt = torch.randint(0, 128, (2, 12)), torch.randint(0, 128, (2, 1))
    calls = _counting_layer_calls(monkeypatch, layer_cls)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no layers run one by one)
        out = model(ids.to("jax"), labels=ids.to("jax"))
    # only the layers run as they are get the real cache (Gemma 2's first period, to learn its arguments)
    assert calls["n"] == {"llama": 0, "gemma2": 2, "gemma3": 1}[arch]
    expected = ref(ids, labels=ids)
    torch.testing.assert_close(out.logits.detach().cpu(), expected.logits.detach(), atol=1e-5, rtol=1e-5)
    _assert_same_cache(out.past_key_values, expected.past_key_values)
    out.loss.backward()
    expected.loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-6, rtol=1e-4, msg=n)
    with torch.no_grad():  # a decoding step from the filled cache, scanned too
        calls.clear()
        step = model(nxt.to("jax"), past_key_values=out.past_key_values)
        assert calls["n"] == {"llama": 0, "gemma2": 2, "gemma3": 1}[arch]
        expected_step = ref(nxt, past_key_values=expected.past_key_values)
    torch.testing.assert_close(step.logits.cpu(), expected_step.logits, atol=1e-5, rtol=1e-5)
    _assert_same_cache(step.past_key_values, expected_step.past_key_values)


GIVEN_THE_CACHE = collections.Counter()  # _CachedAttention calls, by whether they got the cache (not the scan's)


class _CachedAttention(nn.Module):
    """A layer that keeps its keys in a transformers cache, indexed by its ``layer_idx``."""

    def __init__(self, layer_idx, reads=None):
        super().__init__()
        self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8)
        self.layer_idx, self.reads = layer_idx, reads
        self.scale = torch.full((8,), float(layer_idx + 1))  # (a plain tensor of each layer's own)

    def forward(self, x, cache=None):
        GIVEN_THE_CACHE[type(cache).__name__ == "DynamicCache"] += 1
        k, v = self.k(x)[:, None], self.v(x)[:, None]
        if self.reads == "length":  # (asks the cache more than update: the scan does not stand in for that)
            k = k + cache.get_seq_length(self.layer_idx)
        if self.reads == "index":  # (uses its index otherwise than as the cache's)
            k = k * (self.layer_idx + 1)
        if self.reads == "index type":  # (asks its index's type: a layer's own value)
            k = k * 2 if isinstance(self.layer_idx, int) else k
        if self.reads == "own tensor":  # (reads another attribute of its own, before the cache's index)
            k = k * self.scale.shape[0] if isinstance(self.scale, torch.Tensor) else k
        keys, values = cache.update(k, v, self.layer_idx)
        attention = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", self.k(x)[:, None], keys), -1)
        return x + torch.einsum("bhqk,bhkd->bhqd", attention, values)[:, 0]


class _CachedStack(nn.Module):
    def __init__(self, reads=None, n=4):
        super().__init__()
        self.layers = nn.ModuleList([_CachedAttention(i, reads) for i in range(n)])

    def forward(self, x, cache, stop=None):
        for i, layer in enumerate(self.layers):
            if i == stop:
                break
            x = layer(x, cache)
        return x


@pytest.mark.parametrize("reads", [None, "length", "index", "index type", "own tensor"])
def test_layers_using_a_transformers_cache_match_torch(reads):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = _CachedStack(reads)
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    x = torch.randn(2, 5, 8)
    cache, expected_cache = transformers.DynamicCache(), transformers.DynamicCache()
    for step in range(2):  # (a prefill, then a step reading the cache)
        GIVEN_THE_CACHE.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (layers that read more of the cache run one by one, and say so)
            got = model(x[:, step:step + 3].to("jax"), cache)
        assert GIVEN_THE_CACHE[True] == (0 if reads is None else 4)  # (scanned: the layers got a stand-in)
        expected = ref(x[:, step:step + 3], expected_cache)
        torch.testing.assert_close(got.cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
        _assert_same_cache(cache, expected_cache)


def test_a_loop_that_stops_early_leaves_the_later_layers_caches():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = _CachedStack(n=5)
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    x = torch.randn(2, 3, 8)
    cache, expected_cache = transformers.DynamicCache(), transformers.DynamicCache()
    got = model(x.to("jax"), cache, stop=3)  # (the scan ran all five)
    torch.testing.assert_close(got.cpu(), ref(x, expected_cache, stop=3).detach(), atol=1e-5, rtol=1e-5)
    assert len(cache.layers) == len(expected_cache.layers) == 3
    _assert_same_cache(cache, expected_cache)


def test_a_training_step_making_a_transformers_cache_scans_under_jit():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = _CachedStack()
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(2, 5, 8)

    def step(m, o, x):
        loss = m(x, transformers.DynamicCache()).square().mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    jitted = t2j.jit(functools.partial(step, model, opt))
    for _ in range(2):
        GIVEN_THE_CACHE.clear()
        loss = jitted(x.to("jax"))
        assert GIVEN_THE_CACHE[True] == 0
        torch.testing.assert_close(loss.cpu(), step(ref, ref_opt, x).detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-6, rtol=1e-5)


def test_gradients_reach_the_layers_through_the_cache_a_scan_filled():
    """A second chunk reads the first chunk's keys from the cache: its loss differentiates into
    the layers through them, as in torch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = _CachedStack()
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    x = torch.randn(2, 6, 8)
    for m, device in ((ref, "cpu"), (model, "jax")):
        cache = transformers.DynamicCache()
        m(x[:, :3].to(device), cache)
        m(x[:, 3:].to(device), cache).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-4)


def test_hf_layers_scan_again_after_a_call_collecting_hidden_states(monkeypatch):
    """The first call with output_hidden_states / output_attentions installs transformers' capturing hooks on
    the layers for good: that call runs them one by one (each layer's hook records its output), later calls
    that collect nothing scan again (the hooks do nothing then)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    ref = transformers.LlamaForCausalLM(cfg)
    model = t2j.use_scan_layers(copy.deepcopy(ref).to("jax"))
    cls = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    runs = collections.Counter()
    forward = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: runs.update(["n"]) or forward(self, *a, **k))
    ids = torch.randint(0, 128, (2, 8))
    for kwargs, layer_runs in (({}, 1), (dict(output_hidden_states=True, output_attentions=True), 3),
                               (dict(output_hidden_states=True), 3), ({}, 1)):
        runs.clear()
        out = model(ids.to("jax"), use_cache=False, **kwargs)
        assert runs["n"] == layer_runs, kwargs
        expected = ref(ids, use_cache=False, **kwargs)
        torch.testing.assert_close(out.logits.detach().cpu(), expected.logits.detach(), atol=1e-5, rtol=1e-5)
        for name in ("hidden_states", "attentions"):
            got, want = getattr(out, name) or (), getattr(expected, name) or ()
            assert len(got) == len(want)
            for a, b in zip(got, want):
                torch.testing.assert_close(a.detach().cpu(), b.detach(), atol=1e-5, rtol=1e-5)
