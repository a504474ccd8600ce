"""torch.nn.functional corner cases OpInfo samples do not reach, against torch CPU."""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch2jax as t2j


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_with_a_nan_coordinate(mode):
    # the NaN point reads zeros (NaN where its weights are NaN) and sends no gradient to the input
    results = []
    for d in ("cpu", "jax"):
        x = torch.arange(16.0).reshape(1, 1, 4, 4).to(d).requires_grad_()
        grid = torch.tensor([[[[0.5, 0.0], [float("nan"), 0.0], [1.5, 0.2]]]], device=d).requires_grad_()
        out = F.grid_sample(x, grid, mode=mode, align_corners=True)
        out.sum().backward()
        results.append((out.detach().cpu(), x.grad.cpu(), grid.grad.cpu()))
    (out, gx, gg), (jout, jgx, jgg) = results
    torch.testing.assert_close(jout, out, equal_nan=True)
    torch.testing.assert_close(jgx, gx)
    torch.testing.assert_close(jgg, gg, equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("align_corners", [False, True])
def test_affine_grid_spaced_as_torch_native_kernel(align_corners):
    # torch's decomposition spaces the grid with linspace(-a, a), an ulp off the native kernel's
    # linspace(-1, 1) * (n - 1) / n: a 2x nearest downsample (every sample a half-pixel tie) moved
    img = torch.arange(2 * 16 * 22.0).view(2, 1, 16, 22)
    for size in [(2, 1, 8, 11), (2, 1, 5, 7), (2, 1, 3, 4, 5)]:
        nd = len(size) - 2
        theta = torch.eye(nd, nd + 1).expand(2, nd, nd + 1)
        expected = F.affine_grid(theta, size, align_corners=align_corners)
        grid = F.affine_grid(theta.to("jax"), size, align_corners=align_corners)
        assert grid.shape == expected.shape and torch.equal(grid.cpu(), expected), size
        if nd == 2:
            out = F.grid_sample(img.to("jax"), grid, mode="nearest", align_corners=align_corners)
            assert torch.equal(out.cpu(), F.grid_sample(img, expected, mode="nearest", align_corners=align_corners))


@pytest.mark.parametrize("dims,mode", [(2, 0), (2, 1), (2, 2), (3, 0)])
def test_half_precision_grid_sampling_in_one_program_rounds_as_torch(dims, mode):
    # one compiled program: XLA may contract a product and the sum it feeds into one fused multiply-add,
    # where torch's Half kernel rounds the product; a coordinate off by one rounding picks another pixel
    torch.manual_seed(0)
    sample = torch.grid_sampler_2d if dims == 2 else torch.grid_sampler_3d
    f = t2j.jit(lambda x, g, pad, align: sample(x, g, mode, pad, align))
    x = torch.randn(2, 3, *((5, 7) if dims == 2 else (4, 5, 6)), dtype=torch.float16)
    g = (torch.rand(2, *(9,) * dims, dims) * 2.4 - 1.2).half()
    for pad in range(3):
        for align in (False, True):
            expected = sample(x, g, mode, pad, align)
            assert torch.equal(f(x.to("jax"), g.to("jax"), pad, align).cpu(), expected), (pad, align)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_sdpa_takes_a_mask_and_is_causal_together_as_cpus_flash_kernel(mask_dtype):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.randn(5, 6) if mask_dtype is torch.float32 else torch.randn(5, 6) > -1
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    got = F.scaled_dot_product_attention(q.to("jax"), k.to("jax"), v.to("jax"), attn_mask=mask.to("jax"),
                                         is_causal=True)
    torch.testing.assert_close(got.cpu(), expected, equal_nan=True)


def test_embedding_bag_checks_indices_inside_jit_when_asked():
    weight = torch.randn(10, 4, device="jax")
    with t2j.env(check_indices="always"):
        bag = t2j.jit(lambda i: F.embedding_bag(i, weight, torch.tensor([0], device="jax")))
        assert bag(torch.tensor([1, 9], device="jax")).shape == (1, 4)
        with pytest.raises(RuntimeError, match=r"Index 1 of input takes value 11 which is not in the valid range \[0, 10\)"):
            bag(torch.tensor([1, 11], device="jax"))


@pytest.mark.parametrize("case", ["padded row", "causal", "gqa", "3-d", "broadcast heads"])
def test_sdpa_gradients_match_cpus_kernels(case):
    # a query row whose scores are all about finfo.min (a padded position under HF's additive mask)
    # gets the gradients of torch's flash kernel, which recomputes probabilities from a rounded lse
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    mask, kwargs = torch.zeros(5, 6), {}
    mask[0] = torch.finfo(torch.float32).min
    if case == "causal":
        mask, kwargs = None, {"is_causal": True}
    elif case == "gqa":
        k, v, kwargs = k[:, :2], v[:, :2], {"enable_gqa": True}
    elif case == "3-d":  # torch's math kernel: softmax's own gradient
        q, k, v = q[0], k[0], v[0]
    elif case == "broadcast heads":  # (multi-query attention without enable_gqa: the math kernel too)
        k, v = k[:, :1], v[:, :1]
    grads = []
    for d in ("cpu", "jax"):
        leaves = [t.clone().to(d).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, attn_mask=None if mask is None else mask.to(d), **kwargs)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(d)).sum().backward()
        grads.append([t.grad.cpu() for t in leaves])
    for expected, got in zip(*grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_attention_under_torch_func_transforms_and_higher_order_autograd():
    # per-sample gradients (vmap of grad), double backward with the math backend asked for or on
    # 3-D inputs (where torch's CPU backend takes its math path), hessian and forward mode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def results(device):
        q = torch.randn(3, 2, 4, 8, generator=torch.Generator().manual_seed(0)).to(device)

        def sd(q):
            return F.scaled_dot_product_attention(q, q.cos(), q.sin())

        out = [torch.func.vmap(torch.func.grad(lambda r: sd(r).sum()))(q)]
        with sdpa_kernel(SDPBackend.MATH):
            q4 = q.clone().requires_grad_()
            (g,) = torch.autograd.grad(sd(q4).square().sum(), q4, create_graph=True)
            out.append(torch.autograd.grad(g.sum(), q4)[0])
        q3 = q[0].clone().requires_grad_()
        (g,) = torch.autograd.grad(sd(q3).square().sum(), q3, create_graph=True)
        out.append(torch.autograd.grad(g.sum(), q3)[0])
        out.append(torch.func.hessian(lambda z: sd(z).sum())(q[0, 0, :2]))
        out.append(torch.func.jvp(sd, (q[0],), (torch.ones_like(q[0]),))[1])
        return [t.detach().cpu() for t in out]

    for got, want in zip(results("jax"), results("cpu")):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _bce_at_the_edges(x, target):
    return F.binary_cross_entropy(x, target, weight=torch.arange(1.0, 6.0).to(x.device), reduction="sum")


def _bce_of_saturated_sigmoid(x, target):
    return F.binary_cross_entropy(torch.sigmoid(x * 400 - 200), target)


def _multilabel_margin_at_a_zero_hinge(x, target):
    return F.multilabel_margin_loss(x[:4].reshape(1, 4), torch.tensor([[0, 3, -1, 1]], device=x.device))


@pytest.mark.parametrize("loss", [_bce_at_the_edges, _bce_of_saturated_sigmoid, _multilabel_margin_at_a_zero_hinge])
def test_loss_gradients_where_the_loss_is_flat_match_torch(loss):
    """Where the forward's clamp or hinge is flat (a probability of exactly 0 or 1, a hinge term
    of exactly 0), torch's backward formulas give finite values JAX's derivative of the forward
    would not (NaN, half a subgradient)."""
    x = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.3])
    target = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.6])
    grads = []
    for device in ("cpu", "jax"):
        leaf = x.to(device, copy=True).requires_grad_()
        loss(leaf, target.to(device)).backward()
        grads.append(leaf.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_embedding_max_norm_renormalizes_the_weight_in_place_without_the_host(norm_type):
    torch.manual_seed(0)
    weight = torch.randn(6, 3) * 3
    indices = torch.tensor([[0, 2], [2, 5]])
    want_weight = weight.clone()
    want = torch.nn.functional.embedding(indices, want_weight, max_norm=1.0, norm_type=norm_type)
    got_weight = weight.to("jax")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no host fallback
        got = torch.nn.functional.embedding(indices.to("jax"), got_weight, max_norm=1.0, norm_type=norm_type)
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(got_weight.cpu(), want_weight)  # rows 0, 2, 5 scaled once each


@pytest.mark.parametrize("q_shape,kv_shape", [((2, 4, 5, 8), (2, 1, 5, 8)), ((1, 5, 8), (3, 5, 8))])
def test_sdpa_broadcasts_batch_and_head_dimensions_as_torch(q_shape, kv_shape):
    # one key / value head for every query head: multi-query attention (Falcon's default)
    torch.manual_seed(0)
    q, k, v = torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    jx = [t.to("jax").requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*cpu)
    got = F.scaled_dot_product_attention(*jx)
    torch.testing.assert_close(got.detach().cpu(), want.detach(), atol=1e-5, rtol=1e-5)
    want.square().sum().backward()
    got.square().sum().backward()
    for a, b in zip(jx, cpu):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_native_channel_shuffle_takes_any_layout_as_the_cpu_kernel_does(layout):
    x = torch.randn(2, 6, 3, 4)
    x = {"contiguous": x, "channels_last": x.to(memory_format=torch.channels_last),
         "transposed": x.transpose(2, 3)}[layout]
    expected = torch.native_channel_shuffle(x, 3)
    out = torch.native_channel_shuffle(x.to("jax"), 3)
    assert torch.equal(out.cpu(), expected) and out.stride() == expected.stride()


@pytest.mark.parametrize("case", ["math_backend", "three_dims", "fused"])
def test_scaled_dot_product_attention_boolean_masks_on_every_path(case):
    """A boolean mask (True: attend) is made additive before torch's math path too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shape = (4, 6, 8) if case == "three_dims" else (2, 4, 6, 8)
    q, k, v = (torch.randn(shape) for _ in range(3))
    mask = torch.rand(6, 6) > 0.4
    mask[:, 0] = True
    scope = sdpa_kernel(SDPBackend.MATH) if case == "math_backend" else contextlib.nullcontext()
    with scope:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = F.scaled_dot_product_attention(q.to("jax"), k.to("jax"), v.to("jax"), attn_mask=mask.to("jax"))
    torch.testing.assert_close(out.cpu(), expected)


@pytest.mark.parametrize("op, shape, samples", [
    (torch.ops.aten.fractional_max_pool3d, (4, 5, 5, 5), (2, 4, 3)),
    (torch.ops.aten.fractional_max_pool2d, (4, 5, 5), (3, 4, 2)),
    (torch.ops.aten.fractional_max_pool2d, (2, 4, 5, 5), (2, 5, 2)),
    (torch.ops.aten.fractional_max_pool2d, (2, 4, 5, 5), (1, 4, 2)),
    (torch.ops.aten.fractional_max_pool3d, (2, 4, 5, 5, 5), (2, 4, 2)),
])
def test_fractional_max_pool_reads_its_samples_as_torch(op, shape, samples):
    # an unbatched input given a batch of samples uses the first (nn.FractionalMaxPool3d's
    # no-batch-dim inputs); samples of the wrong size are refused with torch's message
    x, u = torch.randn(shape), torch.rand(samples)
    k = [2] * (3 if op is torch.ops.aten.fractional_max_pool3d else 2)
    try:
        expected = op(x, k, k, u)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=re.escape(str(e))):
            op(x.to("jax"), k, k, u.to("jax"))
        return
    got = op(x.to("jax"), k, k, u.to("jax"))
    assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])


def test_multi_margin_loss_refuses_mismatched_target_and_weight_as_torch():
    for target, weight in [(torch.zeros(3, dtype=torch.long), None), (torch.zeros((), dtype=torch.long), None),
                           (torch.zeros(5, dtype=torch.long), torch.ones(3)),
                           (torch.zeros(5, dtype=torch.long), torch.ones(2, 2))]:
        with pytest.raises((RuntimeError, ValueError)) as expected:
            F.multi_margin_loss(torch.ones(5, 4), target, weight=weight)
        with pytest.raises(expected.type, match=re.escape(str(expected.value))):
            F.multi_margin_loss(torch.ones(5, 4, device="jax"), target.to("jax"),
                                weight=None if weight is None else weight.to("jax"))


@pytest.mark.parametrize("shape, layout", [
    ((4, 3), lambda x: x.t().contiguous().t()),
    ((2, 3, 4), lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)),
    ((2, 3, 4, 4), lambda x: x.to(memory_format=torch.channels_last)),
    ((2, 3, 4, 4), lambda x: x.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)),
    ((2, 3, 2, 4, 4), lambda x: x.to(memory_format=torch.channels_last_3d)),
])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_lays_its_result_out_as_the_cpu_kernel(shape, layout, training):
    # the input's suggested memory format: channels_last stays, any other layout gives a contiguous
    # result (``bn(x.transpose(1, 2)).transpose(1, 2).view(...)`` is then refused, as in torch)
    norm = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
    module = norm[len(shape)](3).train(training)
    x = layout(torch.randn(shape))
    expected = module(x)
    got = copy.deepcopy(module).to("jax")(x.to("jax"))
    assert got.stride() == expected.stride()
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("k", "v", "message"), [
    ((1, 2, 5, 6), (1, 2, 5, 4), "query [1, 2, 3, 4] and key [1, 2, 5, 6] must have the same last dimension"),
    ((1, 2, 5, 4), (1, 2, 6, 4), "key [1, 2, 5, 4] and value [1, 2, 6, 4] must have the same length"),
])
def test_scaled_dot_product_attention_refuses_sizes_that_do_not_fit(k, v, message):
    # (torch's CPU kernel gives a bmm message for the first and reads past the value for the second)
    with t2j.env(), pytest.raises(RuntimeError, match=re.escape(message)):
        F.scaled_dot_product_attention(torch.ones(1, 2, 3, 4, device="jax"), torch.ones(k, device="jax"),
                                       torch.ones(v, device="jax"))


@pytest.mark.parametrize("pool, shape, size", [
    (F.adaptive_avg_pool1d, (1, 2, 3), 0), (F.adaptive_max_pool2d, (2, 3, 3), (0, 2)),
    (F.adaptive_avg_pool2d, (1, 2, 3, 3), (2, 0)), (F.adaptive_max_pool3d, (1, 2, 3, 3, 3), (1, 0, 2)),
])
def test_adaptive_pools_to_a_zero_size_give_torchs_empty_result(pool, shape, size):
    expected = pool(torch.ones(shape), size)
    for run in (pool, t2j.jit(pool)):
        result = run(torch.ones(shape, device="jax"), size)
        assert (result.shape, result.dtype) == (expected.shape, expected.dtype)


def test_embedding_bag_max_of_no_indices_gives_empty_bags():
    def bags(weight, device):
        out = F.embedding_bag(torch.empty(0, dtype=torch.long, device=device), weight, torch.zeros(2, dtype=torch.long,
                                                                                                    device=device),
                              mode="max")
        out.sum().backward()
        return out

    weight = torch.ones(3, 2, requires_grad=True)
    expected = bags(weight, "cpu")
    for run in (bags, t2j.jit(bags)):
        w = torch.ones(3, 2, device="jax", requires_grad=True)
        torch.testing.assert_close(run(w, "jax").cpu(), expected)
        torch.testing.assert_close(w.grad.cpu(), weight.grad)


def test_sdpa_of_empty_heads_attends_uniformly_as_torch():
    # torch's default scale 1 / sqrt(0) is inf, which it applies to the empty queries and keys: the scores stay 0
    results = []
    for d in ("cpu", "jax"):
        q = torch.ones(1, 2, 3, 0, device=d)
        v = torch.arange(30.0, device=d).view(1, 2, 3, 5).requires_grad_()
        out = F.scaled_dot_product_attention(q, q, v, is_causal=True)
        out.sum().backward()
        results.append((out.detach().cpu(), v.grad.cpu()))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_threshold_and_rrelu_eval_read_their_numbers_in_float32(dtype):
    # torch's kernels take a Python threshold / slope in float32, not rounded to float16 / bfloat16:
    # an element equal to the rounded threshold is above it, and the mean slope scales in float32
    edge = torch.tensor(0.3337, dtype=dtype).item()
    x = torch.cat([torch.tensor([edge, -edge, 0.3335]), torch.randn(200, generator=torch.Generator().manual_seed(0))])
    x = x.to(dtype)
    for op in (lambda t: F.threshold(t, 0.3337, 9.0), lambda t: F.rrelu(t, 0.1, 0.3337, training=False)):
        assert torch.equal(op(x.to("jax")).cpu(), op(x))


def test_inplace_rrelu_is_lowered_and_compiles():
    # F.rrelu_ (nn.RReLU(inplace=True)) calls rrelu_with_noise_, which ran on the host through torch
    x = torch.linspace(-2, 2, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluated = F.rrelu_(x.to("jax"), training=False)
        trained = t2j.jit(lambda t: F.rrelu_(t * 1, 0.1, 0.3, training=True))(x.to("jax")).cpu()
    torch.testing.assert_close(evaluated.cpu(), F.rrelu_(x.clone(), training=False))
    slopes = (trained / x)[x < 0]
    assert torch.equal(trained[x >= 0], x[x >= 0]) and slopes.min() >= 0.1 and slopes.max() <= 0.3
