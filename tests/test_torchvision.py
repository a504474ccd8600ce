"""The torchvision model zoo and torchvision.ops on the jax device, against torch CPU.

Models are built with ``weights=None`` (nothing downloaded) on CPU with a fixed seed,
deep-copied to the jax device and run on the same tiny inputs. torchvision's custom ops
(nms, roi_align, ...) are compared with its CPU kernels, or where the installed wheel's
C++ extension cannot load, with the reference kernels of `tv_compat`.

Eager execution on the jax device compiles each op for each new shape, so a full-size
architecture costs tens of seconds even at 32x32: the default run keeps reduced-depth or
reduced-width variants and the ops; the zoo proper is marked slow.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import torch2jax as t2j

tv_compat = pytest.importorskip("tv_compat")
try:
    torchvision = tv_compat.import_torchvision()
except ImportError:  # pragma: no cover - torchvision not installed
    pytest.skip("torchvision is not installed", allow_module_level=True)

from torchvision import models, ops  # noqa: E402
from torchvision.models.resnet import BasicBlock, ResNet  # noqa: E402
from torchvision.models.vision_transformer import VisionTransformer  # noqa: E402


@pytest.fixture
def t2j_env():
    with t2j.env():
        yield


# -- comparison -----------------------------------------------------------------------


def _assert_close(actual, expected, what, tol=1e-4):
    """float32 parity: error bounded by ``tol`` relative to the reference's scale."""
    expected = expected.detach()
    scale = max(expected.abs().max().item(), 1e-2) if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach().cpu(), expected, atol=tol * scale, rtol=tol,
                               msg=lambda m: f"{what}: {m}")


def _randomize(model, seed=0):
    """Give every normalization layer non-trivial statistics and affine terms, and every
    classifier head non-zero weights: torchvision zero-initializes some of them (ViT's head,
    residual BN gammas), which would make an all-zero output agree trivially."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)) and m.weight is not None:
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            if isinstance(m, nn.Linear):
                bound = 1 / math.sqrt(m.in_features)
                m.weight.copy_((torch.rand(m.weight.shape, generator=g) * 2 - 1) * bound)
                if m.bias is not None:
                    m.bias.copy_((torch.rand(m.bias.shape, generator=g) * 2 - 1) * bound)
    return model


def _tensors(out):
    """The floating-point tensors of a model output (tensor, tuple, dict, list of dicts)."""
    if isinstance(out, torch.Tensor):
        return {"out": out}
    items = out.items() if isinstance(out, dict) else enumerate(out)
    found = {}
    for k, v in items:
        for name, t in _tensors(v).items() if not isinstance(v, torch.Tensor) else [("", v)]:
            found[f"{k}.{name}".rstrip(".")] = t
    return found


def _eval_forward(model, x, tol=1e-4):
    model = _randomize(model).eval()
    with torch.no_grad():
        expected = model(x)
    with t2j.env():
        on_jax = copy.deepcopy(model).to("jax")
        with torch.no_grad():
            actual = on_jax(x.to("jax"))
    expected, actual = _tensors(expected), _tensors(actual)
    assert expected.keys() == actual.keys()
    for name in expected:
        if expected[name].is_floating_point():
            _assert_close(actual[name], expected[name], name, tol)
        else:
            assert torch.equal(actual[name].cpu(), expected[name]), name


def _train_grads(model, x, tol=1e-6):
    """Train-mode forward (BatchNorm batch statistics, dropout off) and every gradient.

    In float64: through a stack of train-mode BatchNorms over a batch of two, float32
    rounding alone moves the first layer's gradients by ~1e-3 relative, which would hide
    a real error behind a loose tolerance.
    """
    model = _randomize(model).double()
    x = x.double()
    for m in model.modules():
        # random masks come from different generators on the two devices
        if isinstance(m, (nn.Dropout, ops.StochasticDepth)):
            m.p = 0.0
    model.train()
    on_jax = copy.deepcopy(model)
    out = model(x)
    out.square().mean().backward()
    with t2j.env():
        on_jax = on_jax.to("jax")
        out_j = on_jax(x.to("jax"))
        out_j.square().mean().backward()
        _assert_close(out_j, out, "output", tol)
        for (name, p), (_, pj) in zip(model.named_parameters(), on_jax.named_parameters()):
            assert pj.grad is not None, name
            _assert_close(pj.grad, p.grad, f"grad {name}", tol)
        for (name, b), (_, bj) in zip(model.named_buffers(), on_jax.named_buffers()):
            if b.is_floating_point():
                _assert_close(bj, b, f"buffer {name}", tol)


def _small_resnet():
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _small_vit():
    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10)


def _image(size=32, batch=2, seed=0):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


# -- classification: eval forward -------------------------------------------------------

FAST = {
    "resnet_small": (_small_resnet, 32),
    "mobilenet_v3_small_w025": (lambda: models.mobilenet_v3_small(weights=None, num_classes=10, width_mult=0.25), 32),
    "vit_small": (_small_vit, 32),
}

ZOO = {
    "resnet18": (lambda: models.resnet18(weights=None, num_classes=10), 32),
    "resnet50": (lambda: models.resnet50(weights=None, num_classes=10), 32),
    "mobilenet_v2": (lambda: models.mobilenet_v2(weights=None, num_classes=10), 32),
    "mobilenet_v3_small": (lambda: models.mobilenet_v3_small(weights=None, num_classes=10), 32),
    "efficientnet_b0": (lambda: models.efficientnet_b0(weights=None, num_classes=10), 32),
    "regnet_x_400mf": (lambda: models.regnet_x_400mf(weights=None, num_classes=10), 32),
    "densenet121": (lambda: models.densenet121(weights=None, num_classes=10), 32),
    "squeezenet1_0": (lambda: models.squeezenet1_0(weights=None, num_classes=10), 32),
    "shufflenet_v2_x0_5": (lambda: models.shufflenet_v2_x0_5(weights=None, num_classes=10), 32),
    "mnasnet0_5": (lambda: models.mnasnet0_5(weights=None, num_classes=10), 32),
    "convnext_tiny": (lambda: models.convnext_tiny(weights=None, num_classes=10), 32),
    "swin_t": (lambda: models.swin_t(weights=None, num_classes=10), 64),
    "googlenet": (lambda: models.googlenet(weights=None, num_classes=10, aux_logits=True, init_weights=True), 64),
    "inception_v3": (lambda: models.inception_v3(weights=None, num_classes=10, aux_logits=True, init_weights=True),
                     75),
}


@pytest.mark.parametrize("name", [n if n == "vit_small" else pytest.param(n, marks=pytest.mark.slow) for n in FAST])
def test_classifier_eval(name):
    build, size = FAST[name]
    torch.manual_seed(0)
    _eval_forward(build(), _image(size))


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_zoo_eval(name):
    build, size = ZOO[name]
    torch.manual_seed(0)
    _eval_forward(build(), _image(size))


# -- classification: train-mode gradients ------------------------------------------------


@pytest.mark.parametrize("name", ["resnet_small", pytest.param("vit_small", marks=pytest.mark.slow)])
def test_classifier_train_grads(name):
    build, size = FAST[name]
    torch.manual_seed(0)
    _train_grads(build(), _image(size))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_zoo_train_grads(name):
    build, size = ZOO[name]
    torch.manual_seed(0)
    _train_grads(build(), _image(size))


# -- t2j.jit train step ------------------------------------------------------------------


def _sgd_step(model):
    # binary fractions: t2j.jit carries the hyperparameters as float32 scalars, and 0.05
    # rounded to float32 alone moves float64 losses by 5e-8 by the second step
    opt = torch.optim.SGD(model.parameters(), lr=0.0625, momentum=0.875)

    def step(x, y):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet_small", "vit_small"])
def test_jit_sgd_train_step(name):
    """Three jitted SGD steps (forward, backward, momentum update, BatchNorm statistics in
    one XLA program) follow torch CPU's losses and end at its parameters.

    In float64: with train-mode BatchNorm over a batch of two the trajectory is chaotic
    enough that float32 rounding alone separates the losses by the third step.
    """
    build, size = FAST[name]
    torch.manual_seed(0)
    model = _randomize(build()).double().train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    x, y = _image(size).double(), torch.tensor([1, 7])
    jax_model = copy.deepcopy(model)
    step = _sgd_step(model)
    expected = [step(x, y).item() for _ in range(3)]
    with t2j.env():
        jax_model = jax_model.to("jax")
        jstep = t2j.jit(_sgd_step(jax_model))
        xj, yj = x.to("jax"), y.to("jax")
        actual = [jstep(xj, yj).item() for _ in range(3)]
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=1e-7, rtol=1e-7)
    for (pname, p), (_, pj) in zip(model.named_parameters(), jax_model.named_parameters()):
        _assert_close(pj, p, f"param {pname}", 1e-6)
    for (bname, b), (_, bj) in zip(model.named_buffers(), jax_model.named_buffers()):
        if b.is_floating_point():
            _assert_close(bj, b, f"buffer {bname}", 1e-6)


# -- segmentation and detection ----------------------------------------------------------

SEGMENTATION = {
    "lraspp_mobilenet_v3_large": lambda: models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3),
    "deeplabv3_mobilenet_v3_large": lambda: models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3),
    "fcn_resnet50": lambda: models.segmentation.fcn_resnet50(weights=None, weights_backbone=None, num_classes=3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SEGMENTATION)
def test_segmentation_eval(name):
    torch.manual_seed(0)
    _eval_forward(SEGMENTATION[name](), _image(64))


def _detections(model, images):
    with torch.no_grad():
        return model(images)


# Few proposals keep the CPU reference kernels (Python loops where torchvision's C++
# extension is missing) fast; the score threshold 0 keeps every detection so that the
# comparison does not hinge on which boxes sit right at a threshold.
DETECTION = {
    "fasterrcnn_mobilenet_v3_large_320_fpn": lambda: models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64,
        rpn_pre_nms_top_n_test=50, rpn_post_nms_top_n_test=20, box_score_thresh=0.0, box_detections_per_img=10),
    "retinanet_resnet50_fpn": lambda: models.detection.retinanet_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64, topk_candidates=20,
        score_thresh=0.0, detections_per_img=10),
    "ssdlite320_mobilenet_v3_large": lambda: models.detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, topk_candidates=20,
        score_thresh=0.0, detections_per_img=10),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", DETECTION)
def test_detection_eval(name):
    torch.manual_seed(0)
    model = _randomize(DETECTION[name]()).eval()
    # Random heads score every box near 1/num_classes; sharper class logits keep near-ties
    # (whose order decides which of two overlapping boxes nms keeps) out of the comparison.
    with torch.no_grad():
        for mname, m in model.named_modules():
            if mname.split(".")[-1] in ("cls_logits", "cls_score"):
                for p in m.parameters():
                    p.mul_(30)
    images = [torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    expected = _detections(model, images)
    with t2j.env():
        actual = _detections(copy.deepcopy(model).to("jax"), [im.to("jax") for im in images])
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert e["boxes"].shape[0] > 0
        _assert_same_detections({k: v.cpu() for k, v in a.items()}, e, f"image {i}")


def _assert_same_detections(actual, expected, what, tol=1e-3):
    """Same detections, up to the order of tied scores: each expected (label, score, box)
    is matched to a distinct actual one within tolerance."""
    assert actual["boxes"].shape == expected["boxes"].shape, what
    _assert_close(actual["scores"], expected["scores"], f"{what} scores", tol)
    scale = max(expected["boxes"].abs().max().item(), 1.0)
    free = list(range(len(actual["boxes"])))
    for label, score, box in zip(expected["labels"], expected["scores"], expected["boxes"]):
        close = [j for j in free if actual["labels"][j] == label
                 and abs(actual["scores"][j] - score) <= tol * max(abs(score.item()), 1e-2)
                 and (actual["boxes"][j] - box).abs().max() <= tol * scale]
        assert close, f"{what}: no match for label {int(label)} score {float(score)} box {box.tolist()}"
        free.remove(close[0])


# -- torchvision.ops ---------------------------------------------------------------------


def _boxes(n, size, seed):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * size
    wh = torch.rand(n, 2, generator=g) * size / 2 + 0.5
    return torch.cat([xy, xy + wh], 1)


def _rois(n, size, batch, seed):
    idx = torch.randint(0, batch, (n, 1), generator=torch.Generator().manual_seed(seed)).float()
    # some boxes reach past the far edges, where torchvision's sampling rule zeroes samples
    return torch.cat([idx, _boxes(n, size * 1.2, seed)], 1)


def _jax(*tensors):
    return [t.to("jax") for t in tensors]


def test_nms_and_batched_nms(t2j_env):
    boxes, scores = _boxes(60, 32, 0), torch.rand(60, generator=torch.Generator().manual_seed(1))
    idxs = torch.randint(0, 3, (60,), generator=torch.Generator().manual_seed(2))
    for thr in (0.2, 0.5):
        assert torch.equal(ops.nms(*_jax(boxes, scores), thr).cpu(), ops.nms(boxes, scores, thr))
        assert torch.equal(ops.batched_nms(*_jax(boxes, scores, idxs), thr).cpu(),
                           ops.batched_nms(boxes, scores, idxs, thr))
    assert ops.nms(*_jax(boxes[:0], scores[:0]), 0.5).shape == (0,)


def test_nms_under_jit_names_the_op(t2j_env):
    """nms's output shape depends on the scores: the trace stops there and the call runs eagerly,
    with a warning naming the op; fullgraph=True raises instead."""
    cpu = _boxes(8, 32, 0), torch.rand(8)
    boxes, scores = _jax(*cpu)
    with pytest.warns(UserWarning, match="runs eagerly.*torchvision::nms has an output shape"):
        kept = t2j.jit(lambda b, s: ops.nms(b, s, 0.5))(boxes, scores)
    assert torch.equal(kept.cpu(), ops.nms(*cpu, 0.5))
    with pytest.raises(t2j.OpError, match="torchvision::nms"):
        t2j.jit(lambda b, s: ops.nms(b, s, 0.5), fullgraph=True)(boxes, scores)


@pytest.mark.slow
def test_box_ops_and_focal_loss(t2j_env):
    a, b = _boxes(7, 32, 0), _boxes(5, 32, 1)
    _assert_close(ops.box_iou(*_jax(a, b)), ops.box_iou(a, b), "box_iou")
    _assert_close(ops.generalized_box_iou(*_jax(a, b)), ops.generalized_box_iou(a, b), "giou")
    _assert_close(ops.box_area(*_jax(a)), ops.box_area(a), "box_area")
    _assert_close(ops.box_convert(*_jax(a), "xyxy", "cxcywh"), ops.box_convert(a, "xyxy", "cxcywh"), "convert")
    logits, target = torch.randn(6, 4), (torch.rand(6, 4) > 0.5).float()
    for reduction in ("none", "mean"):
        _assert_close(ops.sigmoid_focal_loss(*_jax(logits, target), reduction=reduction),
                      ops.sigmoid_focal_loss(logits, target, reduction=reduction), f"focal {reduction}")


@pytest.mark.parametrize("sampling_ratio,aligned", [(2, True), pytest.param(0, False, marks=pytest.mark.slow)])
def test_roi_align_forward_backward(t2j_env, sampling_ratio, aligned):
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(0))
    rois = _rois(5, 10, 2, 1)
    grad = torch.randn(5, 3, 3, 3, generator=torch.Generator().manual_seed(2))
    xc = x.clone().requires_grad_()
    expected = ops.roi_align(xc, rois, (3, 3), 0.8, sampling_ratio, aligned)
    expected.backward(grad)
    xj = x.to("jax").requires_grad_()
    actual = ops.roi_align(xj, rois.to("jax"), (3, 3), 0.8, sampling_ratio, aligned)
    actual.backward(grad.to("jax"))
    _assert_close(actual, expected, "roi_align")
    _assert_close(xj.grad, xc.grad, "roi_align grad")


def test_roi_align_jitted(t2j_env):
    x, rois = torch.randn(2, 3, 10, 10), _rois(4, 10, 2, 3)
    expected = ops.roi_align(x, rois, (2, 2), 1.0, 2, True)
    actual = t2j.jit(lambda x, r: ops.roi_align(x, r, (2, 2), 1.0, 2, True))(*_jax(x, rois))
    _assert_close(actual, expected, "jitted roi_align")


def test_roi_pool(t2j_env):
    x, rois = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(0)), _rois(5, 10, 2, 1)
    out, argmax = torch.ops.torchvision.roi_pool(x, rois, 0.8, 3, 3)
    out_j, argmax_j = torch.ops.torchvision.roi_pool(*_jax(x, rois), 0.8, 3, 3)
    _assert_close(out_j, out, "roi_pool")
    assert torch.equal(argmax_j.cpu(), argmax)
    # the backward op scatters through the argmax; compared with the same scatter on CPU
    grad = torch.randn(out.shape)
    gj = torch.ops.torchvision._roi_pool_backward(*_jax(grad, rois, argmax_j), 0.8, 3, 3, 2, 3, 10, 10)
    expected = torch.zeros(2, 3, 100)
    for k in range(5):
        for c in range(3):
            for i, a in enumerate(argmax[k, c].flatten().tolist()):
                if a >= 0:
                    expected[int(rois[k, 0]), c, a] += grad[k, c].flatten()[i]
    _assert_close(gj, expected.reshape(2, 3, 10, 10), "roi_pool backward")


@pytest.mark.slow
def test_ps_roi_align_and_pool(t2j_env):
    x, rois = torch.randn(2, 8, 9, 9, generator=torch.Generator().manual_seed(0)), _rois(4, 9, 2, 1)
    _assert_close(ops.ps_roi_align(*_jax(x, rois), (2, 2), 0.9, 2), ops.ps_roi_align(x, rois, (2, 2), 0.9, 2),
                  "ps_roi_align")
    _assert_close(ops.ps_roi_pool(*_jax(x, rois), (2, 2), 0.9), ops.ps_roi_pool(x, rois, (2, 2), 0.9),
                  "ps_roi_pool")


@pytest.mark.parametrize("use_mask", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_deform_conv2d(t2j_env, use_mask):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(1, 4, 6, 6, generator=g), torch.randn(6, 2, 3, 3, generator=g), torch.randn(6, generator=g)
    offset = torch.randn(1, 2 * 2 * 9, 6, 6, generator=g)
    mask = torch.rand(1, 2 * 9, 6, 6, generator=g) if use_mask else None
    expected = ops.deform_conv2d(x, offset, w, b, padding=1, mask=mask)
    actual = ops.deform_conv2d(*_jax(x, offset, w, b), padding=1, mask=None if mask is None else mask.to("jax"))
    _assert_close(actual, expected, "deform_conv2d")
