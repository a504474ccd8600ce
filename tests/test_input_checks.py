"""Input torch rejects is rejected on the jax device too, with torch's exception type and
message; and values at the edges torch defines (activation kinks, bags cut short by
include_last_offset). torch CPU is the oracle: every error case also runs on the CPU, so
the expected message is checked to be torch's own."""

from __future__ import annotations

import re

import jax
import pytest
import torch
import torch.nn.functional as F

import torch2jax as t2j

DEVICES = ("cpu", "jax")
aten = torch.ops.aten


def _t(values, device, **kwargs):
    return torch.tensor(values, device=device, **kwargs)


def _ones(*shape, device):
    return torch.ones(*shape, device=device)


def _case(name, call, error, message):
    """``call(device)`` raises ``error`` with ``message`` in its text."""
    return pytest.param(call, error, message, id=name)


# -- errors -------------------------------------------------------------------------------

_NLL_CASES = [
    _case("nll_loss weight size", lambda d: F.nll_loss(torch.zeros(2, 3, device=d), _t([0, 2], d),
                                                        weight=torch.ones(2, device=d)),
          RuntimeError, "weight tensor should be defined either for all 3 classes or no classes but got weight "
                        "tensor of shape: [2]"),
    _case("cross_entropy weight size", lambda d: F.cross_entropy(torch.zeros(2, 3, device=d), _t([0, 2], d),
                                                                 weight=torch.ones(2, device=d)),
          RuntimeError, "weight tensor should be defined either for all 3 classes or no classes"),
    _case("cross_entropy weight size, label smoothing",
          lambda d: F.cross_entropy(torch.zeros(2, 3, device=d), _t([0, 2], d), weight=torch.ones(2, device=d),
                                    label_smoothing=0.1),
          RuntimeError, "weight tensor should be defined either for all 3 classes or no classes"),
    _case("nll_loss2d weight size", lambda d: F.nll_loss(torch.zeros(2, 3, 4, 4, device=d),
                                                          torch.zeros(2, 4, 4, dtype=torch.long, device=d),
                                                          weight=torch.ones(2, device=d)),
          RuntimeError, "weight tensor should be defined either for all or no classes"),
    _case("nll_loss float target", lambda d: F.nll_loss(torch.zeros(2, 3, device=d), _t([0.0, 2.0], d)),
          RuntimeError, "expected target dtype to be Long or Byte, but got Float"),
    _case("nll_loss int32 target", lambda d: F.nll_loss(torch.zeros(2, 3, device=d), _t([0, 2], d, dtype=torch.int32)),
          RuntimeError, "expected target dtype to be Long or Byte, but got Int"),
    _case("nll_loss2d float target", lambda d: F.nll_loss(torch.zeros(2, 3, 4, 4, device=d),
                                                           torch.zeros(2, 4, 4, device=d)),
          RuntimeError, "expected target dtype to be Long or Byte, but got Float"),
    _case("nll_loss 1-d input, longer target", lambda d: F.nll_loss(torch.zeros(3, device=d), _t([0, 1], d)),
          ValueError, "For 1D input, 1D target must have size 1, but got target size: 2"),
    _case("nll_loss batch size", lambda d: F.nll_loss(torch.zeros(2, 3, device=d), _t([0, 1, 2], d)),
          ValueError, ("Expected input batch_size (2) to match target batch_size (3).")),
    _case("nll_loss_forward batch size", lambda d: aten.nll_loss_forward(torch.zeros(2, 3, device=d),
                                                                          _t([0, 1, 2], d), None, 1, -100),
          RuntimeError, ("size mismatch (got input: [2, 3], target: [3])")),
    _case("nll_loss_forward 3-d input", lambda d: aten.nll_loss_forward(torch.zeros(2, 3, 4, device=d),
                                                                         _t([0, 1], d), None, 1, -100),
          RuntimeError, "input tensor should be 1D or 2D"),
    _case("nll_loss2d size", lambda d: F.nll_loss(torch.zeros(2, 3, 4, 4, device=d),
                                                   torch.zeros(2, 4, 5, dtype=torch.long, device=d)),
          RuntimeError, ("size mismatch (got input: [2, 3, 4, 4] , target: [2, 4, 5]")),
    _case("nll_loss integer input", lambda d: aten.nll_loss_forward(torch.zeros(2, 3, dtype=torch.long, device=d),
                                                                     _t([0, 1], d), None, 1, -100),
          NotImplementedError, "\"nll_loss_out_frame\" not implemented for 'Long'"),
    _case("nll_loss weight dtype", lambda d: F.nll_loss(torch.zeros(2, 3, device=d), _t([0, 1], d),
                                                         weight=torch.ones(3, dtype=torch.float64, device=d)),
          RuntimeError, "expected scalar type Float but found Double"),
    # probabilities of another shape than the input: torch takes them for class indices
    _case("cross_entropy probability target shape", lambda d: F.cross_entropy(torch.zeros(2, 3, device=d),
                                                                                torch.rand(2, 4).to(d)),
          RuntimeError, "0D or 1D target tensor expected, multi-target not supported"),
]

_ONE_HOT_CASES = [
    _case("one_hot too large", lambda d: F.one_hot(_t([3, 0], d), 3),
          RuntimeError, ("Class values must be smaller than num_classes.")),
    _case("one_hot negative", lambda d: F.one_hot(_t([3, -1], d), 3),
          RuntimeError, ("Class values must be non-negative.")),
    _case("one_hot negative, inferred classes", lambda d: F.one_hot(_t([-1, 2], d)),
          RuntimeError, ("Class values must be non-negative.")),
    _case("one_hot empty, inferred classes", lambda d: F.one_hot(_t([], d, dtype=torch.long)),
          RuntimeError, "Can not infer total number of classes from empty tensor."),
]

_MASK_CASES = [
    _case("masked_fill long mask", lambda d: torch.zeros(3, device=d).masked_fill(_t([1, 0, 1], d), 1.0),
          RuntimeError, "masked_fill_ only supports boolean masks, but got mask with dtype long int"),
    _case("masked_fill_ uint8 mask", lambda d: torch.zeros(3, device=d).masked_fill_(_t([1, 0, 1], d).byte(), 1.0),
          RuntimeError, "masked_fill_ only supports boolean masks, but got mask with dtype unsigned char"),
    _case("masked_fill float mask, tensor value",
          lambda d: torch.zeros(3, device=d).masked_fill(_t([1.0, 0.0, 1.0], d), _t(1.0, d)),
          RuntimeError, "masked_fill_ only supports boolean masks, but got mask with dtype float"),
    _case("where long condition", lambda d: torch.where(_t([1, 0], d), 1.0, 0.0),
          RuntimeError, "where expected condition to be a boolean tensor, but got a tensor with dtype Long"),
    _case("where float condition, tensors",
          lambda d: torch.where(_t([1.0, 0.0], d), torch.ones(2, device=d), torch.zeros(2, device=d)),
          RuntimeError, "where expected condition to be a boolean tensor, but got a tensor with dtype Float"),
    _case("masked_scatter long mask",
          lambda d: torch.zeros(3, device=d).masked_scatter(_t([1, 0, 1], d), torch.ones(3, device=d)),
          RuntimeError, "masked_scatter_ only supports boolean masks, but got mask with dtype Long"),
    _case("masked_select long mask", lambda d: torch.zeros(3, device=d).masked_select(_t([1, 0, 1], d)),
          RuntimeError, "masked_select: expected BoolTensor for mask"),
]

_BCE_CASES = [
    _case("binary_cross_entropy input above 1", lambda d: F.binary_cross_entropy(_t([1.5], d), _t([1.0], d)),
          RuntimeError, "all elements of input should be between 0 and 1"),
    _case("binary_cross_entropy NaN input", lambda d: F.binary_cross_entropy(_t([0.5, float("nan")], d),
                                                                              _t([1.0, 1.0], d)),
          RuntimeError, "all elements of input should be between 0 and 1"),
    _case("binary_cross_entropy target below 0", lambda d: F.binary_cross_entropy(_t([0.5], d), _t([-0.5], d)),
          RuntimeError, "all elements of target should be between 0 and 1"),
    _case("binary_cross_entropy target dtype", lambda d: F.binary_cross_entropy(_t([0.5], d),
                                                                                 _t([1.0], d, dtype=torch.float64)),
          RuntimeError, "Found dtype Double but expected Float"),
]

_KERNEL_TOO_LARGE = "Kernel size can't be greater than actual input size"
_OUTPUT_PADDING = "output padding must be smaller than either stride or dilation, but got "

_CONV_CASES = [
    _case("conv2d kernel larger than input",
          lambda d: F.conv2d(_ones(1, 1, 2, 2, device=d), _ones(1, 1, 3, 3, device=d)),
          RuntimeError, ("Calculated padded input size per channel: (2 x 2). Kernel size: (3 x 3). "
                         + _KERNEL_TOO_LARGE)),
    _case("conv1d kernel larger than input", lambda d: F.conv1d(_ones(1, 1, 2, device=d), _ones(1, 1, 3, device=d)),
          RuntimeError, ("Calculated padded input size per channel: (2). Kernel size: (3). "
                         + _KERNEL_TOO_LARGE)),
    _case("conv3d kernel larger in one dimension",
          lambda d: F.conv3d(_ones(1, 1, 2, 4, 4, device=d), _ones(1, 1, 3, 3, 3, device=d)),
          RuntimeError, ("Calculated padded input size per channel: (2 x 4 x 4). Kernel size: (3 x 3 x 3). "
                         + _KERNEL_TOO_LARGE)),
    _case("conv2d dilated kernel larger than input",
          lambda d: F.conv2d(_ones(1, 1, 4, 4, device=d), _ones(1, 1, 3, 3, device=d), dilation=2),
          RuntimeError, ("Calculated padded input size per channel: (4 x 4). Kernel size: (5 x 5). "
                         + _KERNEL_TOO_LARGE)),
    _case("conv2d channels", lambda d: F.conv2d(_ones(1, 2, 4, 4, device=d), _ones(1, 3, 3, 3, device=d)),
          RuntimeError, ("Given groups=1, weight of size [1, 3, 3, 3], expected input[1, 2, 4, 4] to have 3 "
                         "channels, but got 2 channels instead")),
    _case("conv1d channels with groups",
          lambda d: F.conv1d(_ones(1, 4, 4, device=d), _ones(2, 1, 3, device=d), groups=2),
          RuntimeError, ("Given groups=2, weight of size [2, 1, 3], expected input[1, 4, 4] to have 2 "
                         "channels, but got 4 channels instead")),
    _case("conv2d groups divide weight", lambda d: F.conv2d(_ones(1, 4, 4, 4, device=d), _ones(3, 2, 3, 3, device=d),
                                                            groups=2),
          RuntimeError, ("Given groups=2, expected weight to be divisible by 2 at dimension 0")),
    _case("conv2d bias size", lambda d: F.conv2d(_ones(1, 1, 4, 4, device=d), _ones(2, 1, 3, 3, device=d),
                                                 _ones(3, device=d)),
          RuntimeError, ("Given weight of size [2, 1, 3, 3], expected bias to be 1-dimensional with 2 "
                         "elements, but got bias of size [3] instead")),
    _case("convolution input rank",
          lambda d: aten.convolution(_ones(1, 1, 4, 4, 4, device=d), _ones(1, 1, 3, 3, device=d), None, [1, 1],
                                     [0, 0], [1, 1], False, [0, 0], 1),
          RuntimeError, ("Expected 4-dimensional input for 4-dimensional weight [1, 1, 3, 3], but got "
                         "5-dimensional input of size [1, 1, 4, 4, 4] instead")),
    _case("convolution stride length",
          lambda d: aten.convolution(_ones(1, 1, 4, 4, device=d), _ones(1, 1, 3, 3, device=d), None, [1, 1, 1],
                                     [0, 0], [1, 1], False, [0, 0], 1),
          RuntimeError, ("expected stride to be a single integer value or a list of 2 values to match the "
                         "convolution dimensions, but got stride=[1, 1, 1]")),
    _case("convolution negative padding", lambda d: aten.convolution(_ones(1, 1, 4, 4, device=d),
                                                                     _ones(1, 1, 3, 3, device=d), None, [1, 1],
                                                                     [-1, 0], [1, 1], False, [0, 0], 1),
          RuntimeError, "negative padding is not supported"),
    _case("conv2d zero stride", lambda d: F.conv2d(_ones(1, 1, 4, 4, device=d), _ones(1, 1, 3, 3, device=d), stride=0),
          RuntimeError, "non-positive stride is not supported"),
    _case("conv2d zero dilation", lambda d: F.conv2d(_ones(1, 1, 4, 4, device=d), _ones(1, 1, 3, 3, device=d),
                                                     dilation=0),
          RuntimeError, "dilation should be greater than zero"),
    _case("conv2d weight dtype", lambda d: F.conv2d(_ones(1, 1, 4, 4, device=d),
                                                    _ones(1, 1, 3, 3, device=d).double()),
          RuntimeError, "expected scalar type Float but found Double"),
    _case("ConvTranspose2d output padding",
          lambda d: torch.nn.ConvTranspose2d(1, 1, 3, stride=2, output_padding=2).to(d)(_ones(1, 1, 3, 3, device=d)),
          RuntimeError, (_OUTPUT_PADDING + "output_padding_height: 2 output_padding_width: 2 stride_height: 2 "
                         "stride_width: 2 dilation_height: 1 dilation_width: 1")),
    _case("conv_transpose1d output padding",
          lambda d: F.conv_transpose1d(_ones(1, 1, 3, device=d), _ones(1, 1, 3, device=d), stride=2, output_padding=2),
          RuntimeError, (_OUTPUT_PADDING + "output_padding_height: 0 output_padding_width: 2 stride_height: 1 "
                         "stride_width: 2 dilation_height: 1 dilation_width: 1")),
    _case("conv_transpose3d output padding",
          lambda d: F.conv_transpose3d(_ones(1, 1, 3, 3, 3, device=d), _ones(1, 1, 3, 3, 3, device=d), stride=2,
                                       output_padding=(0, 0, 2)),
          RuntimeError, (_OUTPUT_PADDING + "output_padding_depth: 0 output_padding_height: 0 "
                         "output_padding_width: 2 stride_depth: 2")),
    _case("conv_transpose2d output too small",
          lambda d: F.conv_transpose2d(_ones(1, 1, 1, 1, device=d), _ones(1, 1, 1, 1, device=d), padding=1),
          RuntimeError, ("Given input size per channel: (1 x 1). Calculated output size per channel: "
                         "(-1 x -1). Output size is too small")),
    _case("conv_transpose2d channels",
          lambda d: F.conv_transpose2d(_ones(1, 2, 3, 3, device=d), _ones(1, 1, 3, 3, device=d)),
          RuntimeError, ("Given transposed=1, weight of size [1, 1, 3, 3], expected input[1, 2, 3, 3] to "
                         "have 1 channels, but got 2 channels instead")),
]

_CTC = " (while checking arguments for ctc_loss_allocate_outputs)"
_LOG_PROBS = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(0)).log_softmax(2)


def _ctc(d, targets, input_lengths, target_lengths, **kwargs):
    return F.ctc_loss(_LOG_PROBS.to(d), _t(targets, d), _t(input_lengths, d), _t(target_lengths, d), **kwargs)


_CTC_CASES = [
    _case("ctc_loss targets shorter than target_lengths",
          lambda d: F.ctc_loss(torch.zeros(3, 1, 4, device=d).log_softmax(2), _t([[1, 2, 3, 1, 2]], d), _t([3], d),
                               _t([6], d)),
          RuntimeError, ("Expected tensor to have size at least 6 at dimension 1, but got size 5 for "
                         "argument #2 'targets'" + _CTC)),
    _case("ctc_loss concatenated targets too short", lambda d: _ctc(d, [1, 2, 3, 1, 1], [5, 4], [3, 3]),
          RuntimeError, ("Expected tensor to have size 6 at dimension 0, but got size 5 for argument #2 "
                         "'targets'" + _CTC)),
    _case("ctc_loss negative target length", lambda d: _ctc(d, [[1, 2, 3], [1, 1, 0]], [5, 4], [-1, 2]),
          RuntimeError, ("Expected target_lengths to have value at least 0, but got value -1" + _CTC)),
    _case("ctc_loss input length too long", lambda d: _ctc(d, [[1, 2, 3], [1, 1, 0]], [6, 4], [3, 2]),
          RuntimeError, ("Expected input_lengths to have value at most 5, but got value 6" + _CTC)),
    _case("ctc_loss input lengths as a list", lambda d: F.ctc_loss(_LOG_PROBS.to(d), _t([[1, 2, 3], [1, 1, 0]], d),
                                                                   [5, -1], [3, 2]),
          RuntimeError, ("Expected input_lengths to have value at least 0, but got value -1" + _CTC)),
    _case("ctc_loss targets batch", lambda d: _ctc(d, [[1, 2, 3]], [5, 4], [3, 2]),
          RuntimeError, ("Expected tensor to have size 2 at dimension 0, but got size 1 for argument #2 "
                         "'targets'" + _CTC)),
    _case("ctc_loss blank", lambda d: _ctc(d, [[1, 2, 3], [1, 1, 0]], [5, 4], [3, 2], blank=4),
          RuntimeError, "blank must be in label range"),
    _case("ctc_loss input_lengths size", lambda d: _ctc(d, [[1, 2, 3], [1, 1, 0]], [5, 4, 3], [3, 2]),
          RuntimeError, "input_lengths must be of size batch_size"),
]

_PIXEL_SHUFFLE_CASES = [
    _case("pixel_shuffle channels", lambda d: F.pixel_shuffle(_ones(1, 3, 2, 2, device=d), 2),
          RuntimeError, ("pixel_shuffle expects its input's 'channel' dimension to be divisible by the square "
                         "of upscale_factor, but input.size(-3)=3 is not divisible by 4")),
    _case("pixel_unshuffle height", lambda d: F.pixel_unshuffle(_ones(1, 1, 3, 4, device=d), 2),
          RuntimeError, ("pixel_unshuffle expects height to be divisible by downscale_factor, but "
                         "input.size(-2)=3 is not divisible by 2")),
    _case("pixel_unshuffle factor", lambda d: F.pixel_unshuffle(_ones(1, 1, 4, 4, device=d), 0),
          RuntimeError, "pixel_unshuffle expects a positive downscale_factor, but got 0"),
]


# Values torch's kernels read and check: (inputs, op) so that the op can also be traced
# with the inputs as arguments (see test_value_checks_at_run_time).
_X = [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]


def _value_case(name, inputs, op, error, message):
    return pytest.param(inputs, op, error, message, id=name)


_VALUE_CASES = [
    _value_case("integer division by zero", lambda d: (_t([4, 5], d), _t([2, 0], d)), lambda a, b: a // b,
                RuntimeError, "ZeroDivisionError"),
    _value_case("integer remainder by zero", lambda d: (_t([4, 5], d), _t([2, 0], d)), torch.remainder,
                RuntimeError, "ZeroDivisionError"),
    _value_case("index", lambda d: (_t(_X, d), _t([0, 2], d)), lambda x, i: x[i], IndexError,
                "index 2 is out of bounds for dimension 0 with size 2"),
    _value_case("index negative", lambda d: (_t(_X, d), _t([0, -4], d)), lambda x, i: x[:, i], IndexError,
                "index -4 is out of bounds for dimension 0 with size 3"),  # torch counts the index tensors
    _value_case("index second tensor", lambda d: (_t(_X, d), _t([0, 3], d)), lambda x, i: x[i.clamp(max=1), i],
                IndexError, "index 3 is out of bounds for dimension 1 with size 3"),
    _value_case("index_put", lambda d: (_t(_X, d), _t([5], d)), lambda x, i: x.index_put((i,), _t(1.0, x.device)),
                IndexError, "index 5 is out of bounds for dimension 0 with size 2"),
    _value_case("index_select", lambda d: (_t(_X, d), _t([0, 3], d)), lambda x, i: x.index_select(0, i),
                IndexError, "index out of range in self"),
    _value_case("index_select dim 1", lambda d: (_t(_X, d), _t([0, 3], d)), lambda x, i: x.index_select(1, i),
                RuntimeError, "INDICES element is out of DATA bounds, id=3 axis_dim=3"),  # torch's dim-1 kernel
    _value_case("index_select empty", lambda d: (_t(_X, d)[:0], _t([4], d)), lambda x, i: x.index_select(-1, i),
                RuntimeError, "INDICES element is out of DATA bounds, id=4 axis_dim=3"),
    _value_case("bernoulli probabilities", lambda d: (_t([0.5, 1.5], d),), torch.bernoulli, RuntimeError,
                "Expected p_in >= 0 && p_in <= 1 to be true, but got false."),
    _value_case("gather", lambda d: (_t(_X, d), _t([[0, 3]], d)), lambda x, i: x.gather(1, i), RuntimeError,
                "index 3 is out of bounds for dimension 1 with size 3"),
    _value_case("scatter_add", lambda d: (_t(_X, d), _t([[0, 3]], d)),
                lambda x, i: x.scatter_add(1, i, torch.ones_like(x)), RuntimeError,
                "index 3 is out of bounds for dimension 1 with size 3"),
    _value_case("index_add", lambda d: (_t(_X, d), _t([1, 2], d)), lambda x, i: x.index_add(0, i, torch.ones_like(x)),
                RuntimeError, "index 2 is out of bounds for dimension 0 with size 2"),
    _value_case("index_copy", lambda d: (_t(_X, d), _t([1, -3], d)),
                lambda x, i: x.index_copy(0, i, torch.ones_like(x)), IndexError,
                "index_copy_(): index -3 is out of bounds for dimension 0 with size 2"),
    _value_case("index_fill", lambda d: (_t(_X, d), _t([1, 2], d)), lambda x, i: x.index_fill(0, i, 1.0),
                IndexError, "index 2 is out of bounds for dimension 0 with size 2"),
    _value_case("put", lambda d: (_t(_X, d), _t([-9], d)), lambda x, i: x.put(i, _t([1.0], x.device)), IndexError,
                "out of range: tried to access index -9 on a tensor of 6 elements."),
    _value_case("take", lambda d: (_t(_X, d), _t([6], d)), lambda x, i: x.take(i), IndexError,
                "out of range: tried to access index 6 on a tensor of 6 elements."),
    _value_case("embedding_bag first offset", lambda d: (_t(_X, d), _t([0, 1, 1], d), _t([1, 2], d)),
                lambda w, i, o: F.embedding_bag(i, w, o), RuntimeError, "offsets[0] has to be 0, i.e., the first "
                "sequence in the mini-batch has to start from position 0. However, got 1"),
    _value_case("embedding_bag last offset", lambda d: (_t(_X, d), _t([0, 1, 1], d), _t([0, 5], d)),
                lambda w, i, o: F.embedding_bag(i, w, o), RuntimeError,
                "offsets[-1] can not be greater than input's length 3 but got offsets[-1] of 5"),
    _value_case("embedding", lambda d: (_t(_X, d), _t([1, 2], d)), lambda w, i: F.embedding(i, w), IndexError,
                "index out of range in self"),
    _value_case("nll_loss target", lambda d: (_t(_X, d), _t([0, 3], d)), lambda x, t: F.nll_loss(x, t), IndexError,
                "Target 3 is out of bounds."),
    _value_case("cross_entropy target", lambda d: (_t(_X, d), _t([-2, 0], d)), lambda x, t: F.cross_entropy(x, t),
                IndexError, "Target -2 is out of bounds."),
    _value_case("multi_margin_loss target", lambda d: (_t(_X, d), _t([0, 3], d)),
                lambda x, t: F.multi_margin_loss(x, t), RuntimeError, "target out of range"),
    _value_case("multilabel_margin_loss target", lambda d: (_t(_X, d), _t([[0, -1, 3], [1, 2, -1]], d)),
                lambda x, t: F.multilabel_margin_loss(x, t), RuntimeError, "argument #2 'target' is out of range"),
    _value_case("one_hot class", lambda d: (_t([0, 3], d),), lambda t: F.one_hot(t, 3), RuntimeError,
                "Class values must be smaller than num_classes."),
    _value_case("one_hot negative", lambda d: (_t([0, -1], d),), lambda t: F.one_hot(t, 3), RuntimeError,
                "Class values must be non-negative."),
    _value_case("binary_cross_entropy", lambda d: (_t([0.5, 1.5], d), _t([0.0, 1.0], d)),
                F.binary_cross_entropy, RuntimeError, "all elements of input should be between 0 and 1"),
    _value_case("max_unpool2d", lambda d: (_t([[[[1.0, 2.0]]]], d), _t([[[[0, 9]]]], d)),
                lambda x, i: F.max_unpool2d(x, i, 2), RuntimeError,
                "Found an invalid max index: 9 (output volumes are of size 2x4)"),
    _value_case("max_unpool1d", lambda d: (_t([[[1.0, 2.0]]], d), _t([[[0, -1]]], d)),
                lambda x, i: F.max_unpool1d(x, i, 2), RuntimeError,
                "Found an invalid max index: -1 (output volumes are of size 4x1)"),
    _value_case("masked_scatter source", lambda d: (_t(_X, d), _t([[True, True, False], [True, False, True]], d)),
                lambda x, m: x.masked_scatter(m, _t([1.0, 2.0, 3.0], x.device)), RuntimeError,
                "Number of elements of source < number of ones in mask"),
]
def _i8(d):
    return _t([1, -1, 100], d, dtype=torch.int8)


def _overflow(name, call, ctype="int8_t"):
    return _case(name, call, RuntimeError, f"value cannot be converted to type {ctype} without overflow")


# A Python number a kernel takes as a Scalar must fit the tensor's dtype (c10::checked_convert);
# binary arithmetic (i8 + 1000) wraps instead, as torch does
_SCALAR_CASES = [
    _overflow("fill_", lambda d: _i8(d).fill_(1000)),
    _overflow("full", lambda d: torch.full((2,), 1000, dtype=torch.int8, device=d)),
    _overflow("full_like", lambda d: torch.full_like(_i8(d), 300)),
    _overflow("masked_fill", lambda d: _i8(d).masked_fill(_t([True, False, True], d), 1000)),
    _overflow("clamp", lambda d: _i8(d).clamp(max=1000)),
    _overflow("where", lambda d: torch.where(_t([True, False, True], d), _i8(d), 1000)),
    _overflow("setitem", lambda d: _i8(d).__setitem__(0, 1000)),
    _overflow("setitem mask", lambda d: _i8(d).__setitem__(_t([True, False, True], d), -129)),
    _overflow("add alpha", lambda d: torch.add(_i8(d), _i8(d), alpha=1000)),
    _overflow("index_fill", lambda d: _i8(d).index_fill(0, _t([0], d), 1000)),
    _overflow("scatter value", lambda d: _i8(d).scatter(0, _t([0], d), 1000)),
    _overflow("pow", lambda d: _i8(d) ** 1000),
    _overflow("threshold", lambda d: F.threshold(_i8(d), 1000, 0)),
    _overflow("addcmul value", lambda d: torch.addcmul(_i8(d), _i8(d), _i8(d), value=1000)),
    _overflow("pad value", lambda d: F.pad(_i8(d), (1, 1), value=1000)),
    _overflow("uint8 below minus max", lambda d: torch.zeros(2, dtype=torch.uint8, device=d).fill_(-256), "uint8_t"),
    _overflow("nan into int32", lambda d: torch.zeros(2, dtype=torch.int32, device=d).fill_(float("nan")), "int"),
    _overflow("complex into float", lambda d: torch.zeros(2, device=d).__setitem__(0, 1 + 2j), "float"),
    _overflow("float32 range", lambda d: torch.zeros(2, device=d).fill_(1e300), "float"),
    _overflow("half range", lambda d: torch.zeros(2, dtype=torch.float16, device=d).fill_(1e5), "c10::Half"),
    _case("neg of a bool", lambda d: -_t([True], d), RuntimeError,
          "Negation, the `-` operator, on a bool tensor is not supported. If you are trying to invert a mask, use the"),
    _case("addcdiv of integers", lambda d: torch.addcdiv(*[torch.ones(2, dtype=torch.long, device=d)] * 3),
          RuntimeError, "Integer division with addcdiv is no longer supported, and in a future  release addcdiv"),
    _case("take with an int32 index", lambda d: torch.arange(4.0, device=d).take(_t([1], d, dtype=torch.int32)),
          RuntimeError, "take(): Expected a long tensor for index, but got Int"),
    _case("histogram of no bins", lambda d: torch.histogram(torch.arange(4.0, device=d), bins=-1), RuntimeError,
          "torch.histogram(): bins must be > 0, but got -1 for dimension 0"),
    _case("slice_scatter src size", lambda d: torch.zeros(3, 4, device=d).slice_scatter(torch.arange(4.0, device=d)),
          RuntimeError, "expected src to have a size equal to the slice of self. src size = [4], slice size = [3, 4]"),
    _case("index_fill value tensor of one dimension",
          lambda d: torch.zeros(3, 4, device=d).index_fill(0, _t([0, 2], d), torch.ones(1, device=d)),
          RuntimeError, "index_fill_ only supports a 0-dimensional value tensor, but got tensor with 1 dimension(s)."),
    _case("index_put dtypes", lambda d: torch.zeros(3, device=d).index_put_((_t([0], d),), _t(1, d)), RuntimeError,
          "Index put requires the source and destination dtypes match, got Float for the destination and Long for "
          "the source."),
]


def _bools(d):
    return _t([True, False], d)


def _f64(d):
    return torch.ones(1, dtype=torch.float64, device=d)


_BOOL_SUB = "Subtraction, the `-` operator, with a bool tensor is not supported"

# operand dtypes a kernel rejects before any promotion, with torch's exception type
_DTYPE_CASES = [
    _case("sub of a bool", lambda d: _ones(2, device=d) - _bools(d), RuntimeError, _BOOL_SUB),
    _case("rsub of a bool", lambda d: 1 - _bools(d), RuntimeError, _BOOL_SUB),
    _case("sub of a Python bool", lambda d: _ones(2, device=d) - True, RuntimeError, _BOOL_SUB),
    _case("sub_ of a bool", lambda d: _ones(2, device=d).sub_(_bools(d)), RuntimeError, _BOOL_SUB),
    _case("sub of two bools", lambda d: _bools(d) - _bools(d), RuntimeError,
          "Subtraction, the `-` operator, with two bool tensors is not supported"),
    _case("argmax of bools", lambda d: _bools(d).argmax(), RuntimeError, "argmax(): does not support bool input"),
    _case("argmin of bools", lambda d: _bools(d).argmin(0), RuntimeError, "argmin(): does not support bool input"),
    _case("scatter src dtype", lambda d: torch.zeros(3, device=d).scatter(0, _t([0], d), _f64(d)), RuntimeError,
          "scatter(): Expected self.dtype to be equal to src.dtype"),
    _case("scatter_add src dtype", lambda d: torch.zeros(3, device=d).scatter_add_(0, _t([0], d), _f64(d)),
          RuntimeError, "scatter(): Expected self.dtype to be equal to src.dtype"),
    _case("index_add source dtype", lambda d: torch.zeros(3, device=d).index_add(0, _t([0], d), _t([1], d)),
          RuntimeError, "index_add_(): self (Float) and source (Long) must have the same scalar type"),
    _case("index_copy source dtype", lambda d: torch.zeros(3, device=d).index_copy(0, _t([0], d), _t([1], d)),
          RuntimeError, "index_copy_(): self and source expected to have the same dtype, but got (self) Float and "
                        "(source) Long"),
    _case("lerp end dtype", lambda d: torch.zeros(1, device=d).lerp(_f64(d), 0.5), RuntimeError,
          "expected dtype float for `end` but got dtype double"),
    _case("lerp weight dtype", lambda d: torch.zeros(1, device=d).lerp(_ones(1, device=d), _f64(d)), RuntimeError,
          "expected dtype float for `weight` but got dtype double"),
    _case("bitwise_and of floats", lambda d: _ones(2, device=d) & _ones(2, device=d), NotImplementedError,
          "\"bitwise_and_cpu\" not implemented for 'Float'"),
    _case("shift of floats", lambda d: _ones(2, device=d) << 1, NotImplementedError,
          "\"lshift_cpu\" not implemented for 'Float'"),
    _case("floor of complex", lambda d: torch.ones(2, dtype=torch.complex64, device=d).floor(), NotImplementedError,
          "floor is not supported for complex inputs"),
    _case("remainder of complex", lambda d: torch.ones(2, dtype=torch.complex64, device=d) % 2, NotImplementedError,
          "\"remainder_cpu\" not implemented for 'ComplexFloat'"),
]


def _long(*shape, d):
    return torch.zeros(*shape, dtype=torch.long, device=d)


def _complex(d):
    return _t([1 + 2j, -1.5j], d)


_INDEX_SHAPE_CASES = [
    _case("mask assignment of another shape", lambda d: torch.zeros(3, 4, device=d).__setitem__(
        torch.tensor([True, False], device=d), 1.0), IndexError,
        "The shape of the mask [2] at index 0 does not match the shape of the indexed tensor [3, 4] at index 0"),
    _case("gather index larger than self", lambda d: torch.gather(torch.ones(3, 4, device=d), 1, _long(4, 2, d=d)),
          RuntimeError, "Size does not match at dimension 0 expected index [4, 2] to be no larger than self [3, 4] "
                        "apart from dimension 1"),
    _case("gather int16 index", lambda d: torch.gather(torch.ones(3, 4, device=d), 0,
                                                       torch.zeros(1, 4, dtype=torch.int16, device=d)),
          RuntimeError, "gather(): Expected dtype int32/int64 for index"),
    _case("scatter index larger than src", lambda d: torch.ones(3, 4, device=d).scatter(0, _long(2, 3, d=d),
                                                                                        torch.ones(1, 3, device=d)),
          RuntimeError, "Expected index [2, 3] to be no larger than self [3, 4] apart from dimension 0 and to be no "
                        "larger size than src [1, 3]"),
    _case("scatter value, index larger than self", lambda d: torch.ones(3, 4, device=d).scatter(0, _long(2, 5, d=d), 1.0),
          RuntimeError, "Expected index [2, 5] to be no larger than self [3, 4] apart from dimension 0"),
    _case("scatter_add int16 index", lambda d: torch.ones(3, 4, device=d).scatter_add(
        0, torch.zeros(2, 3, dtype=torch.int16, device=d), torch.ones(2, 3, device=d)),
          RuntimeError, "scatter(): Expected dtype int32/int64 for index"),
    _case("index_select matrix index", lambda d: torch.ones(3, 4, device=d).index_select(0, _long(1, 2, d=d)),
          IndexError, "index_select(): Index is supposed to be a vector"),
    _case("index_select int16 index", lambda d: torch.ones(3, 4, device=d).index_select(
        0, torch.zeros(2, dtype=torch.int16, device=d)), RuntimeError, "Expected dtype int32 or int64 for index"),
    _case("index_reduce with sum", lambda d: torch.ones(4, 3, device=d).index_reduce_(
        0, _long(2, d=d), torch.ones(2, 3, device=d), "sum"), RuntimeError,
          "index_reduce(): Expected reduce to be one of prod, mean, amax or amin but got sum."),
    _case("index_reduce float64 source", lambda d: torch.ones(4, 3, device=d).index_reduce_(
        0, _long(2, d=d), torch.ones(2, 3, device=d, dtype=torch.float64), "prod"), RuntimeError,
          "index_reduce_(): self (Float) and source (Double) must have the same scalar type"),
    _case("index_reduce matrix index", lambda d: torch.ones(4, 3, device=d).index_reduce_(
        0, _long(1, 2, d=d), torch.ones(2, 3, device=d), "amax"), IndexError,
          "index_reduce_(): Index is supposed to be a vector, but got dim: 2 with type: Long and size: [1, 2]"),
    _case("index_reduce float index", lambda d: torch.ones(4, 3, device=d).index_reduce_(
        0, torch.zeros(2, device=d), torch.ones(2, 3, device=d), "amin"), RuntimeError,
          "index_reduce_(): Expected dtype int32/int64 for index but got: Float"),
    _case("index_reduce source of another shape", lambda d: torch.ones(4, 3, device=d).index_reduce_(
        0, _long(2, d=d), torch.ones(2, 2, device=d), "prod"), RuntimeError,
          "source tensor shape must match self tensor shape, excluding the specified dimension. Got self.shape = "
          "[4, 3] source.shape = [2, 2]"),
    _case("index_reduce more indices than source rows", lambda d: torch.ones(4, 3, device=d).index_reduce_(
        0, _long(3, d=d), torch.ones(2, 3, device=d), "mean"), RuntimeError,
          "index_reduce_(): Number of indices (3) should be equal to source.size(dim): (2), for dim: 0"),
    _case("masked_scatter float source into long", lambda d: _long(3, d=d).masked_scatter_(
        torch.tensor([True, False, True], device=d), torch.tensor([1.7, 2.9], device=d)), RuntimeError,
          "masked_scatter: expected self and source to have same dtypes but gotLong and Float"),
]

# torch's CPU kernels that refuse a dtype the lowering could compute
_KERNEL_DTYPE_CASES = [
    _case("round of bools", lambda d: torch.round(_bools(d)), NotImplementedError, "not implemented for 'Bool'"),
    _case("floor_ of bools", lambda d: _bools(d).floor_(), NotImplementedError, "not implemented for 'Bool'"),
    _case("frac of bools", lambda d: torch.frac(_bools(d)), NotImplementedError, "\"frac_cpu\" not implemented for 'Bool'"),
    _case("round of complex", lambda d: torch.round(_complex(d)), NotImplementedError,
          "not implemented for 'ComplexFloat'"),
    _case("relu of bools", lambda d: torch.relu(_bools(d)), RuntimeError, "Boolean inputs not supported for relu"),
    _case("relu of complex", lambda d: torch.relu(_complex(d)), NotImplementedError,
          "clamp is not supported for complex types"),
    _case("pow of bools", lambda d: _bools(d) ** _bools(d), NotImplementedError, "\"pow\" not implemented for 'Bool'"),
    _case("addcmul of bools", lambda d: torch.addcmul(_bools(d), _bools(d), _bools(d)), NotImplementedError,
          "\"addcmul_cpu_out\" not implemented for 'Bool'"),
    _case("floor division of bools", lambda d: _bools(d) // _bools(d), NotImplementedError,
          "\"div_floor_cpu\" not implemented for 'Bool'"),
    _case("remainder of bools", lambda d: _bools(d) % _bools(d), NotImplementedError,
          "\"remainder_cpu\" not implemented for 'Bool'"),
    _case("floor division of complex", lambda d: _complex(d) // 2, NotImplementedError,
          "\"div_floor_cpu\" not implemented for 'ComplexFloat'"),
    _case("truncating division of complex", lambda d: torch.div(_complex(d), 2, rounding_mode="trunc"),
          NotImplementedError, "\"div_trunc_cpu\" not implemented for 'ComplexFloat'"),
    _case("shift of bools", lambda d: _bools(d) << _bools(d), NotImplementedError,
          "\"lshift_cpu\" not implemented for 'Bool'"),
    _case("topk of bools", lambda d: _bools(d).topk(1), RuntimeError, "topk does not support bool dtypes on CPU"),
    _case("kthvalue of bools", lambda d: _bools(d).kthvalue(1), NotImplementedError,
          "\"kthvalue_cpu\" not implemented for 'Bool'"),
    _case("kthvalue of an empty dim", lambda d: torch.empty(2, 0, device=d).kthvalue(1), IndexError,
          "kthvalue(): Expected reduction dim 1 to have non-zero size."),
    _case("inf norm of an empty tensor", lambda d: torch.linalg.vector_norm(torch.empty(0, 2, device=d), float("inf")),
          RuntimeError, "linalg.vector_norm cannot compute the inf norm on an empty tensor because the operation"),
    _case("negative norm over an empty dim", lambda d: torch.norm(torch.empty(0, 2, device=d), -2.0, dim=-2),
          RuntimeError, "cannot compute the -2 norm on the dimension -2because this dimension is empty"),
    _case("adaptive_avg_pool2d of an empty spatial dim",
          lambda d: F.adaptive_avg_pool2d(torch.ones(1, 2, 0, 3, device=d), 2),
          RuntimeError, "adaptive_avg_pool2d(): Expected input to have non-zero size for non-batch dimensions, but "
                        "input has sizes [1, 2, 0, 3] with dimension 2 being empty"),
    _case("adaptive_avg_pool3d of no channels", lambda d: F.adaptive_avg_pool3d(torch.ones(1, 0, 2, 2, 2, device=d), 2),
          RuntimeError, "adaptive_avg_pool3d(): Expected input to have non-zero size for non-batch dimensions, but "
                        "input has sizes [1, 0, 2, 2, 2] with dimension 1 being empty"),
    _case("adaptive_avg_pool2d backward of a zero size",
          lambda d: F.adaptive_avg_pool2d(torch.ones(1, 2, 3, 3, device=d, requires_grad=True),
                                          (0, 2)).sum().backward(),
          RuntimeError, "adaptive_avg_pool2d_backward(): Expected grad_output to have non-zero size for non-batch "
                        "dimensions, but grad_output has sizes [1, 2, 0, 2] with dimension 2 being empty"),
    _case("interpolate to a zero size", lambda d: F.interpolate(torch.ones(1, 2, 3, device=d), size=0), RuntimeError,
          "Input and output sizes should be greater than 0, but got input (W: 3) and output (W: 0)"),
    _case("bilinear resize of an empty dim", lambda d: F.interpolate(torch.ones(1, 2, 0, 3, device=d), size=(2, 2),
                                                                      mode="bilinear"),
          RuntimeError,
          "Input and output sizes should be greater than 0, but got input (H: 0, W: 3) output (H: 2, W: 2)"),
    _case("antialiased resize of no channels", lambda d: F.interpolate(torch.ones(1, 0, 3, 3, device=d), size=(2, 2),
                                                                       mode="bicubic", antialias=True),
          RuntimeError, "Non-empty 4D data tensor expected but got a tensor with sizes [1, 0, 3, 3]"),
    _case("reflection pad of no channels", lambda d: F.pad(torch.ones(1, 0, 2, device=d), (1, 1), mode="reflect"),
          RuntimeError, "Expected 2D or 3D (batch mode) tensor with possibly 0 batch size and other non-zero "
                        "dimensions for input, but got: [1, 0, 2]"),
    _case("replication pad of an empty dim", lambda d: F.pad(torch.ones(1, 2, 0, 2, device=d), (1, 1, 0, 0),
                                                             mode="replicate"),
          RuntimeError, "Expected 3D or 4D (batch mode) tensor with possibly 0 batch size and other non-zero "
                        "dimensions for input, but got: [1, 2, 0, 2]"),
    _case("unfold of no channels", lambda d: F.unfold(torch.ones(1, 0, 3, 3, device=d), 2), RuntimeError,
          "Expected 3D or 4D (batch mode) tensor with possibly 0 batch size and other non-zero dimensions for input, "
          "but got: [1, 0, 3, 3]"),
    _case("fold of no columns", lambda d: F.fold(torch.ones(1, 4, 0, device=d), (2, 2), 2), RuntimeError,
          "Expected 2D or 3D (batch mode) tensor for input with possibly 0 batch size and non-zero dimensions for "
          "input, but got: [1, 4, 0]"),
    _case("embedding of no rows", lambda d: F.embedding(_t([0], d), torch.ones(0, 3, device=d)), RuntimeError,
          "index_select(): self indexing axis dim should be positive"),
    _case("kthvalue's k out of range", lambda d: torch.ones(3, device=d).kthvalue(4), RuntimeError,
          "kthvalue(): selected number k out of range for dimension 0"),
    _case("median of bools", lambda d: _bools(d).median(), NotImplementedError,
          "\"median_cpu\" not implemented for 'Bool'"),
    _case("searchsorted of complex", lambda d: torch.searchsorted(_complex(d), _complex(d)), NotImplementedError,
          "\"searchsorted_out_cpu\" not implemented for 'ComplexFloat'"),
    _case("isin of bools", lambda d: torch.isin(_bools(d), _bools(d)), RuntimeError,
          "Unsupported input type encountered for isin(): Bool"),
    _case("hypot of integers", lambda d: torch.hypot(_t([3], d), _t([4], d)), NotImplementedError,
          "\"hypot_cpu\" not implemented for 'Long'"),
    _case("lerp of integers", lambda d: torch.lerp(_t([1], d), _t([3], d), 0.5), NotImplementedError,
          "\"lerp_kernel_scalar\" not implemented for 'Long'"),
    _case("logcumsumexp of integers", lambda d: _t([1, 2], d).logcumsumexp(0), NotImplementedError,
          "\"logcumsumexp_out_cpu\" not implemented for 'Long'"),
    _case("<<= of bools", lambda d: _bools(d).__ilshift__(1), RuntimeError,
          "result type Long can't be cast to the desired output type Bool"),
    _case("cumsum_ of bools", lambda d: _bools(d).cumsum_(0), NotImplementedError,
          "\"cumsum_out_cpu\" not implemented for 'Bool'"),
    _case("cumprod_ of bools", lambda d: _bools(d).cumprod_(0), NotImplementedError,
          "\"cumprod_out_cpu\" not implemented for 'Bool'"),
    _case("gcd of floats", lambda d: torch.gcd(_t([4.0], d), _t([6.0], d)), NotImplementedError,
          "\"gcd_cpu\" not implemented for 'Float'"),
    _case("lcm out= of floats", lambda d: torch.lcm(_t([4.0], d), _t([6.0], d), out=torch.empty(1, device=d)),
          NotImplementedError, "\"lcm_cpu\" not implemented for 'Float'"),
    _case("frac_ of integers", lambda d: _t([1, 2], d).frac_(), NotImplementedError,
          "\"frac_cpu\" not implemented for 'Long'"),
    _case("logaddexp of integers", lambda d: torch.logaddexp(_t([1], d), _t([2], d)), NotImplementedError,
          "\"logaddexp_cpu\" not implemented for 'Long'"),
    _case("atan2 of complex", lambda d: torch.atan2(_complex(d), _complex(d)), NotImplementedError,
          "\"atan2_cpu\" not implemented for 'ComplexFloat'"),
    _case("deg2rad of complex", lambda d: torch.deg2rad(_complex(d)), RuntimeError,
          "deg2rad is not supported for complex tensors."),
    _case("clamp of bools by bools", lambda d: torch.clamp(_bools(d), _bools(d), _bools(d)), NotImplementedError,
          "\"clamp_cpu\" not implemented for 'Bool'"),
    _case("igamma of integers", lambda d: torch.igamma(_t([1], d), _t([2], d)), NotImplementedError,
          "\"igamma_cpu\" not implemented for 'Long'"),
    _case("bessel_j0 of float16", lambda d: torch.special.bessel_j0(_t([1.0], d, dtype=torch.float16)),
          NotImplementedError, "\"bessel_j0_cpu\" not implemented for 'Half'"),
    _case("polar of float16", lambda d: torch.polar(*[_t([1.0], d, dtype=torch.float16)] * 2), NotImplementedError,
          "\"polar_cpu\" not implemented for 'Half'"),
    _case("nanmean of complex", lambda d: torch.nanmean(_complex(d)), RuntimeError,
          "nansum on CPU does not support complex inputs"),
    _case("histogram of float16", lambda d: torch.histogram(_t([1.0, 2.0], d, dtype=torch.float16), 2),
          NotImplementedError, "\"histogramdd\" not implemented for 'Half'"),
    _case("unique of complex", lambda d: torch.unique(_complex(d)), NotImplementedError,
          "\"unique\" not implemented for 'ComplexFloat'"),
    _case("bucketize of bools", lambda d: torch.bucketize(_bools(d), _bools(d)), NotImplementedError,
          "\"searchsorted_out_cpu\" not implemented for 'Bool'"),
    _case("selu of integers", lambda d: F.selu(_t([1, -2], d)), NotImplementedError,
          "\"elu_cpu\" not implemented for 'Long'"),
    _case("gelu of bools", lambda d: F.gelu(_bools(d)), NotImplementedError,
          "\"GeluKernelImpl\" not implemented for 'Bool'"),
    _case("hardtanh of uint8", lambda d: F.hardtanh(_t([1], d, dtype=torch.uint8)), RuntimeError,
          "cannot do hardtanh on an unsigned type with negative limits"),
    _case("layer_norm of integers", lambda d: F.layer_norm(_t([[1, 2]], d), (2,)), NotImplementedError,
          "\"LayerNormKernelImpl\" not implemented for 'Long'"),
    _case("batch_norm of integers", lambda d: torch.nn.BatchNorm1d(1).to(d)(_t([[1], [2]], d)),
          NotImplementedError, "\"batch_norm\" not implemented for 'Long'"),
    _case("max_pool2d of bools", lambda d: F.max_pool2d(_bools(d).view(1, 1, 2), 1), NotImplementedError,
          "\"max_pool2d\" not implemented for 'Bool'"),
    _case("adaptive_avg_pool2d of integers", lambda d: F.adaptive_avg_pool2d(_t([[[1, 2, 3, 4]]], d), (1, 2)),
          NotImplementedError, "\"adaptive_avg_pool2d\" not implemented for 'Long'"),
    _case("max_unpool1d of integers", lambda d: F.max_unpool1d(_t([[[1, 2]]], d), _t([[[0, 2]]], d), 2),
          NotImplementedError, "\"max_unpool2d\" not implemented for 'Long'"),
    _case("interpolate of int64", lambda d: F.interpolate(_t([[[1, 2]]], d), scale_factor=2.0), NotImplementedError,
          "\"compute_indices_weights_nearest\" not implemented for 'Long'"),
    _case("grid_sample of integers", lambda d: F.grid_sample(_t([[[[1, 2]]]], d), _t([[[[0, 0]]]], d),
                                                             align_corners=False),
          NotImplementedError, "\"grid_sampler_2d_cpu_kernel_impl\" not implemented for 'Long'"),
    _case("reflection pad of bools", lambda d: F.pad(_bools(d).view(1, 1, 2), (1, 1), mode="reflect"),
          NotImplementedError, "\"reflection_pad1d\" not implemented for 'Bool'"),
    _case("conv1d of bools", lambda d: F.conv1d(_bools(d).view(1, 1, 2), _bools(d).view(1, 1, 2)),
          NotImplementedError, "\"slow_conv2d_cpu\" not implemented for 'Bool'"),
    _case("unfold of integers", lambda d: F.unfold(_t([[[[1, 2]]]], d), (1, 2)), NotImplementedError,
          "\"im2col_out_cpu\" not implemented for 'Long'"),
    _case("mse_loss of integers", lambda d: F.mse_loss(_t([1], d), _t([2], d)), NotImplementedError,
          "\"mse_cpu\" not implemented for 'Long'"),
    _case("multi_margin_loss of integers", lambda d: F.multi_margin_loss(_t([[1, 2]], d), _t([0], d)),
          NotImplementedError, "\"multi_margin_loss_cpu_kernel\" not implemented for 'Long'"),
    _case("ctc_loss of float16", lambda d: F.ctc_loss(torch.zeros(3, 1, 2, dtype=torch.float16, device=d),
                                                     _t([[1]], d), [3], [1]),
          NotImplementedError, "\"ctc_loss_cpu\" not implemented for 'Half'"),
    _case("bilinear of bools", lambda d: F.bilinear(_bools(d).view(1, 2), _bools(d).view(1, 2),
                                                    torch.ones(1, 2, 2, dtype=torch.bool, device=d)),
          NotImplementedError, "\"bmm\" not implemented for 'Bool'"),
    _case("index_reduce of complex", lambda d: _complex(d).index_reduce(0, _t([0], d), _complex(d)[:1], "prod"),
          NotImplementedError, "\"index_func_\" not implemented for 'ComplexFloat'"),
]


# calls of ops with a refused-dtype check that torch computes: mixed dtypes, Python numbers, out= and
# in-place variants, the dtypes of a kind torch's kernel takes
_CHECKED_BUT_COMPUTED = [
    lambda d: torch.gcd(_t([4, 6], d), _t([6, 9], d)),
    lambda d: torch.atan2(_t([1, 2], d), _t([2, 1], d)),
    lambda d: torch.xlogy(2, _t([1.0, 3.0], d)),
    lambda d: torch.clamp(_bools(d), 0, 1),
    lambda d: torch.special.bessel_j0(_t([1, 2], d)),
    lambda d: F.mse_loss(_t([1.0, 2.0], d), _t([2, 4], d)),
    lambda d: F.hardtanh(_t([-3, 5], d, dtype=torch.uint8), 0.0, 4.0),
    lambda d: F.interpolate(_t([[[1, 2]]], d, dtype=torch.uint8), scale_factor=2.0),
    lambda d: F.conv1d(_t([[[1, 2, 3]]], d), _t([[[1, -1]]], d)),
    lambda d: F.avg_pool2d(_t([[[[1, 2], [3, 4]]]], d), 2),
    lambda d: F.max_unpool1d(_t([[[1.0, 2.0]]], d), _t([[[0, 3]]], d), 2),
    lambda d: torch.histc(_t([1, 2, 2], d).float(), 2),
    lambda d: torch.logaddexp(_complex(d), _complex(d)),
    lambda d: torch.frac(_t([1.5, -2.25], d), out=torch.empty(2, device=d)),
    lambda d: _t([1.5, -2.25], d).frac_(),
]


@pytest.mark.parametrize("call", _CHECKED_BUT_COMPUTED)
def test_refused_dtype_checks_leave_what_torch_computes(call):
    expected = call("cpu")
    torch.testing.assert_close(call("jax").cpu(), expected)
    torch.testing.assert_close(t2j.jit(call, fullgraph=True)("jax").cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call,error,message", _INDEX_SHAPE_CASES + _KERNEL_DTYPE_CASES)
def test_rejects_like_torch_also_under_jit(call, error, message, device):
    with pytest.raises(error, match=re.escape(message)):
        (t2j.jit(call, fullgraph=True) if device == "jax" else call)(device)


@pytest.mark.parametrize("value_device", DEVICES)
def test_mask_assignment_of_one_host_value_of_another_dtype(value_device):
    # torch fills a mask with a one-element CPU value as with a Scalar (masked_fill_); a device value must match
    expected = torch.arange(6.0)
    expected[expected > 2] = torch.tensor(5.5, dtype=torch.float64)
    x = torch.arange(6.0, device="jax")
    value = torch.tensor(5.5, dtype=torch.float64, device=value_device)
    if value_device == "jax":
        with pytest.raises(RuntimeError, match="Index put requires the source and destination dtypes match"):
            x[x > 2] = value
        return
    x[x > 2] = value
    torch.testing.assert_close(x.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_float_numbers_out_of_a_half_dtypes_range_are_infinite_where_torch_takes_them(device):
    # torch.where wraps its number in a scalar_tensor, which converts to float16 / bfloat16 unchecked
    v = torch.arange(4.0, device=device)
    assert torch.where(v > 1, v.half(), 1e5).tolist() == [float("inf")] * 2 + [2.0, 3.0]
    assert torch.where(v > 1, -1e40, v.bfloat16()).tolist() == [0.0, 1.0] + [float("-inf")] * 2
    assert torch.scalar_tensor(1e5, dtype=torch.float16, device=device).item() == float("inf")


@pytest.mark.parametrize("device", DEVICES)
def test_scalars_that_fit_are_accepted_as_torch_does(device):
    u8 = torch.zeros(2, dtype=torch.uint8, device=device).fill_(-255)  # wraps to 1
    i16 = torch.zeros(2, dtype=torch.int16, device=device).fill_(300.5)  # truncates
    wrapped = _i8(device) + 1000
    assert (u8.tolist(), i16.tolist(), wrapped.tolist()) == ([1, 1], [300, 300], [-23, -25, 76])


_EAGER_VALUE_CASES = [_case(p.id, lambda d, inputs=p.values[0], op=p.values[1]: op(*inputs(d)), *p.values[2:])
                      for p in _VALUE_CASES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "call,error,message",
    _NLL_CASES + _ONE_HOT_CASES + _MASK_CASES + _BCE_CASES + _CONV_CASES + _CTC_CASES + _PIXEL_SHUFFLE_CASES
    + _EAGER_VALUE_CASES + _SCALAR_CASES + _DTYPE_CASES + _INDEX_SHAPE_CASES + _KERNEL_DTYPE_CASES,
)
def test_rejects_like_torch(call, error, message, device):
    with pytest.raises(error, match=re.escape(message)) as info:
        call(device)
    assert not isinstance(info.value, (AssertionError, t2j.OpError)), "torch's error, not a wrapped one"


def test_conv_shape_error_also_once_compiled():
    # the lowering is compiled on its third call with a signature; the check runs when it is traced
    x, w = _ones(1, 1, 2, 2, device="jax"), _ones(1, 1, 3, 3, device="jax")
    for _ in range(4):
        with pytest.raises(RuntimeError, match=_KERNEL_TOO_LARGE):
            F.conv2d(x, w)


def test_dtype_checks_hold_under_jit():
    cond = _t([1, 0], "jax")
    with pytest.raises(RuntimeError, match="where expected condition to be a boolean tensor"):
        t2j.jit(lambda c: torch.where(c, 1.0, 0.0))(cond)
    with pytest.raises(RuntimeError, match="masked_fill_ only supports boolean masks"):
        t2j.jit(lambda c: torch.zeros(2, device=c.device).masked_fill(c, 1.0))(cond)


def test_value_checks_are_eager_only():
    # traced values are unknown: one_hot and binary_cross_entropy compute as torch's
    # formulas do, without the check
    one_hot = t2j.jit(lambda t: F.one_hot(t, 3))(_t([0, 2], "jax"))
    assert one_hot.cpu().tolist() == [[1, 0, 0], [0, 0, 1]]
    p, y = torch.rand(4), torch.rand(4)
    bce = t2j.jit(F.binary_cross_entropy)(p.to("jax"), y.to("jax"))
    torch.testing.assert_close(bce.cpu(), F.binary_cross_entropy(p, y))


@pytest.mark.parametrize("inputs,op,error,message", _VALUE_CASES)
def test_value_checks_at_run_time(inputs, op, error, message):
    # under check_indices="always" a traced program checks the values when it runs
    with t2j.env(check_indices="always"):
        jitted = t2j.jit(op)
        with pytest.raises(error, match=re.escape(message)):
            jitted(*inputs("jax"))
        assert jitted.stats["traces"] == 1, "the check ran when the program was traced, not when it ran"


def test_run_time_checks_keep_the_state_and_pass_valid_values():
    w = torch.nn.Parameter(torch.arange(6.0).view(3, 2).to("jax"))
    opt = torch.optim.SGD([w], lr=0.1)

    def step(i):
        opt.zero_grad()
        F.embedding(i, w).sum().backward()
        opt.step()

    with t2j.env(check_indices="always"):
        jitted = t2j.jit(step)
        jitted(_t([0, 2], "jax"))
        before = w.detach().cpu().clone()
        with pytest.raises(IndexError, match="index out of range in self"):
            jitted(_t([0, 3], "jax"))
        assert torch.equal(w.detach().cpu(), before)
        jitted(_t([1, 1], "jax"))
    assert torch.equal(w.detach().cpu(), before - 0.1 * torch.tensor([[0.0, 0.0], [2.0, 2.0], [0.0, 0.0]]))
    # the first call gave w its grad, so the failing call was the first run of a second trace:
    # the slots it re-points (w.grad) are put back
    assert jitted.stats["traces"] == 2 and isinstance(w.grad, t2j.Tensor)


def test_run_time_checks_are_part_of_the_jit_cache_key():
    x = _t(_X, "jax")
    gather = t2j.jit(lambda x, i: x[i])
    assert gather(x, _t([0, 2], "jax")).shape == (2, 3)  # unchecked in the program: JAX clamps
    with t2j.env(check_indices="always"), pytest.raises(IndexError):
        gather(x, _t([0, 2], "jax"))
    assert gather.stats["traces"] == 2


def test_run_time_checks_inside_jax_jit():
    x = _t(_X, "jax")

    @jax.jit
    def f(a, i):
        return t2j.jax_view(t2j.torch_view(a)[t2j.torch_view(i)])

    with t2j.env(check_indices="always"), pytest.raises(Exception, match="index 2 is out of bounds"):
        jax.block_until_ready(f(x.jax(), _t([0, 2], "jax").jax()))


def test_check_indices_values():
    with pytest.raises(ValueError, match="check_indices must be True, False or 'always'"):
        with t2j.env(check_indices="yes"):
            pass


def test_value_checks_follow_check_indices():
    with t2j.env(check_indices=False):
        assert F.one_hot(_t([3, 0], "jax"), 3).cpu().tolist() == [[0, 0, 0], [1, 0, 0]]
        assert torch.isnan(F.binary_cross_entropy(_t([1.5], "jax"), _t([1.0], "jax"))).item()


def test_ctc_loss_with_valid_lengths_under_jit():
    targets, in_len, tg_len = _t([[1, 2, 3], [1, 1, 0]], "cpu"), _t([5, 4], "cpu"), _t([3, 2], "cpu")
    expected = F.ctc_loss(_LOG_PROBS, targets, in_len, tg_len, reduction="none")
    out = t2j.jit(lambda *a: F.ctc_loss(*a, reduction="none"))(
        _LOG_PROBS.to("jax"), targets.to("jax"), in_len.to("jax"), tg_len.to("jax"))
    torch.testing.assert_close(out.cpu(), expected)


# -- values -------------------------------------------------------------------------------

_KINKS = {
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "hardtanh": F.hardtanh,
    "hardtanh(-2, 3)": lambda x: F.hardtanh(x, -2.0, 3.0),
    "relu6": F.relu6,
    "relu": F.relu,
    "leaky_relu": F.leaky_relu,
    "elu": F.elu,
    "threshold": lambda x: F.threshold(x, 1.0, 5.0),
    "hardshrink": F.hardshrink,
    "softshrink": F.softshrink,
    "softplus": lambda x: F.softplus(x, 1.0, 3.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(_KINKS))
def test_activation_kinks_like_torch(name, dtype):
    # at the points where the pieces meet, torch's backward picks a side (hardswish: the
    # outer pieces' slopes, 0 at -3 and 1 at 3)
    values = [-6.0, -3.0, -2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 3.0, 6.0]
    results = []
    for device in DEVICES:
        x = torch.tensor(values, dtype=dtype, device=device, requires_grad=True)
        y = _KINKS[name](x)
        (grad,) = torch.autograd.grad(y, x, torch.full_like(y, 0.75))
        results.append((y.detach().cpu(), grad.cpu()))
    torch.testing.assert_close(results[1], results[0])


def test_hardswish_grad_at_kinks():
    x = torch.tensor([-3.0, 3.0], device="jax", requires_grad=True)
    (grad,) = torch.autograd.grad(F.hardswish(x).sum(), x)
    assert grad.cpu().tolist() == [0.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["hardswish", "hardsigmoid"])
def test_hard_activations_round_like_torch(name, dtype):
    # torch divides by 6 (and 3), where XLA would multiply by a rounded reciprocal
    x0 = (torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    results = []
    for device in DEVICES:
        x = x0.to(device).requires_grad_()
        y = _KINKS[name](x)
        (grad,) = torch.autograd.grad(y, x, torch.full_like(y, 0.37))
        results.append((y.detach().cpu(), grad.cpu()))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


_WEIGHT = torch.arange(10.0).view(5, 2)
_INDICES = torch.tensor([1, 2, 3, 4])
_OFFSETS = torch.tensor([0, 1, 2])  # with include_last_offset: bags [1] and [2]; 3 and 4 in none


def _embedding_bag(device, indices, mode, per_sample_weights=None, padding_idx=None):
    """(output, d weight, d per_sample_weights) of F.embedding_bag with include_last_offset."""
    weight = _WEIGHT.to(device).requires_grad_()
    inputs = [weight]
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.to(device).requires_grad_()
        inputs.append(per_sample_weights)
    out = F.embedding_bag(indices.to(device), weight, _OFFSETS.to(device), mode=mode,
                          per_sample_weights=per_sample_weights, include_last_offset=True, padding_idx=padding_idx)
    grads = torch.autograd.grad((out * torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)).sum(), inputs)
    return [out.detach().cpu()] + [g.cpu() for g in grads]


def test_embedding_bag_include_last_offset_ignores_indices_after_the_last_offset():
    out = F.embedding_bag(_INDICES.to("jax"), _WEIGHT.to("jax"), _OFFSETS.to("jax"), mode="sum",
                          include_last_offset=True)
    assert out.cpu().tolist() == [[2.0, 3.0], [4.0, 5.0]]
    # as torch's default kernel (float32 sum) has it
    expected = F.embedding_bag(_INDICES, _WEIGHT, _OFFSETS, mode="sum", include_last_offset=True)
    torch.testing.assert_close(out.cpu(), expected)


@pytest.mark.parametrize("padding_idx", [None, 2, 4])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)])
def test_embedding_bag_include_last_offset_modes(mode, weighted, padding_idx):
    # torch's other kernels add the entries after the last offset to the last bag (or,
    # for mean, count them in its divisor only), and its backward gives them gradients
    # (float32 sum: reads memory it never wrote); the jax device leaves them out in every
    # mode: the results are torch's for the indices the offsets cover
    per_sample_weights = torch.tensor([1.0, 2.0, 3.0, 4.0]) if weighted else None
    covered = int(_OFFSETS[-1])
    expected = _embedding_bag("cpu", _INDICES[:covered], mode,
                              None if per_sample_weights is None else per_sample_weights[:covered], padding_idx)
    if weighted:  # the entries in no bag get no gradient
        expected[-1] = torch.cat([expected[-1], torch.zeros(len(_INDICES) - covered)])
    torch.testing.assert_close(_embedding_bag("jax", _INDICES, mode, per_sample_weights, padding_idx), expected)


def test_nll_loss_1d_input_with_one_target():
    x = torch.randn(3, generator=torch.Generator().manual_seed(0)).log_softmax(0)
    for reduction in ("none", "mean", "sum"):
        expected = F.nll_loss(x, torch.tensor([2]), weight=torch.tensor([1.0, 2.0, 3.0]), reduction=reduction)
        actual = F.nll_loss(x.to("jax"), torch.tensor([2], device="jax"),
                            weight=torch.tensor([1.0, 2.0, 3.0], device="jax"), reduction=reduction)
        torch.testing.assert_close(actual.cpu(), expected)


def test_nll_loss2d_weight_of_any_shape():
    # nll_loss2d takes a weight of C elements in any shape, as torch's kernel does
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(2, 3, 4, 5, generator=gen).log_softmax(1), torch.randint(0, 3, (2, 4, 5), generator=gen)
    weight = torch.rand(1, 3, generator=gen)
    expected = aten.nll_loss2d_forward(x, target, weight, 1, -100)
    actual = aten.nll_loss2d_forward(x.to("jax"), target.to("jax"), weight.to("jax"), 1, -100)
    torch.testing.assert_close([a.cpu() for a in actual], list(expected))


@pytest.mark.parametrize("device", DEVICES)
def test_index_select_from_an_empty_axis(device):
    x = _t(_X, device)[:, :0]
    assert x.index_select(1, _t([], device).long()).shape == (2, 0)
    with pytest.raises(RuntimeError, match=re.escape("index_select(): self indexing axis dim should be positive")):
        x.index_select(1, _t([0], device))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_index_of_another_rank_gathers_and_scatters_nothing(device):
    x, index = torch.ones(5, device=device), torch.zeros(2, 0, dtype=torch.long, device=device)
    assert x.gather(0, index).shape == (2, 0)
    assert x.scatter(0, index, 2.0).tolist() == [1.0] * 5
    with pytest.raises(RuntimeError, match="Index tensor must have the same number of dimensions"):
        x.gather(0, torch.zeros(2, 1, dtype=torch.long, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_index_tensors_of_other_dtypes_raise_index_error(device):
    x = torch.arange(4.0, device=device)
    for bad in (torch.tensor([0.5], device=device), torch.tensor([1], dtype=torch.int16, device=device)):
        for attempt in (lambda: x[bad], lambda: x.__setitem__(bad, 1.0), lambda: x.index_put_((bad,), x[:1].clone())):
            with pytest.raises(IndexError, match="tensors used as indices must be long, int, byte or bool tensors"):
                attempt()
    assert x[torch.tensor([1], dtype=torch.int32, device=device)].tolist() == [1.0]


_COMPLEX_ORDERINGS = {
    "max": torch.max, "amax": torch.amax, "argmax": torch.argmax, "max dim": lambda z: torch.max(z, 0),
    "sort": torch.sort, "topk": lambda z: torch.topk(z, 1), "cummax": lambda z: torch.cummax(z, 0),
    "median": torch.median, "mode": torch.mode, "kthvalue": lambda z: torch.kthvalue(z, 1),
    "clamp": lambda z: torch.clamp(z, 0), "maximum": lambda z: torch.maximum(z, z), "lt": lambda z: z < z,
    "isposinf": torch.isposinf, "softmax": lambda z: torch.softmax(z, 0),
    "softmax of integers": lambda z: torch.softmax(z.real.long(), 0),
    "log_softmax of bools": lambda z: torch.log_softmax(z.real.bool(), 0),
}


@pytest.mark.parametrize("name", list(_COMPLEX_ORDERINGS))
def test_dtypes_torch_has_no_kernel_for_raise_its_error(name):
    op = _COMPLEX_ORDERINGS[name]
    z = torch.tensor([1j, 2.0])
    with pytest.raises((RuntimeError, NotImplementedError)) as expected:
        op(z)
    with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
        op(z.to("jax"))


@pytest.mark.parametrize("device", DEVICES)
def test_variance_without_degrees_of_freedom_warns(device):
    with pytest.warns(UserWarning, match=re.escape("std_mean(): degrees of freedom is <= 0")):
        torch.std_mean(torch.zeros(1, device=device))
    with pytest.warns(UserWarning, match=re.escape("var(): degrees of freedom is <= 0")):
        torch.zeros(2, device=device).var(correction=2)


@pytest.mark.parametrize("device", DEVICES)
def test_integer_division_and_power_errors(device):
    with pytest.raises(RuntimeError, match="^ZeroDivisionError$"):
        _t([1, 2], device) // 0
    with pytest.raises(RuntimeError, match=r"^Integers to negative integer powers are not allowed\.$"):
        _t([1, 2], device) ** -1


# Common mistakes: the message must be the CPU kernel's, word for word (torch's meta kernels
# word several of them differently)
_MISTAKES = {
    "cat sizes": lambda d: torch.cat([torch.zeros(2, 3, device=d), torch.zeros(2, 4, device=d)]),
    "cat ranks": lambda d: torch.cat([torch.zeros(2, 3, device=d), torch.zeros(3, device=d)]),
    "stack sizes": lambda d: torch.stack([torch.zeros(2, device=d), torch.zeros(2, device=d), torch.zeros(3, device=d)]),
    "broadcast": lambda d: torch.zeros(2, 3, device=d) + torch.zeros(4, device=d),
    "broadcast in place": lambda d: torch.zeros(2, 3, device=d).mul_(torch.zeros(4, 3, device=d)),
    "broadcast three operands": lambda d: torch.where(torch.ones(2, 1, dtype=torch.bool, device=d),
                                                      torch.zeros(3, device=d), torch.zeros(4, device=d)),
    "embedding float indices": lambda d: F.embedding(torch.zeros(2, device=d), torch.zeros(4, 3, device=d)),
    "layer_norm shape": lambda d: F.layer_norm(torch.zeros(2, 3, device=d), (4,)),
    "layer_norm weight": lambda d: F.layer_norm(torch.zeros(2, 3, device=d), (3,), weight=torch.zeros(4, device=d)),
    "gather ranks": lambda d: torch.zeros(2, 3, device=d).gather(1, torch.zeros(2, dtype=torch.long, device=d)),
    "dropout of integers": lambda d: F.dropout(torch.ones(4, dtype=torch.int32, device=d), 0.5),
    "out= of a narrower dtype": lambda d: torch.add(torch.ones(2, device=d), 1,
                                                    out=torch.empty(2, dtype=torch.long, device=d)),
}


@pytest.mark.parametrize("name", list(_MISTAKES))
def test_common_mistakes_get_the_cpu_message(name):
    with pytest.raises(RuntimeError) as expected:
        _MISTAKES[name]("cpu")
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value).split(" (Triggered")[0])) as got:
        _MISTAKES[name]("jax")
    assert not isinstance(got.value, t2j.OpError)


def test_complex_to_real_copy_warns_once(monkeypatch):
    from torch2jax.ops import creation

    monkeypatch.setattr(creation, "_warned_complex_to_real", False)
    z = torch.tensor([1 + 1j], device="jax")
    with pytest.warns(UserWarning, match="Casting complex values to real discards the imaginary part") as record:
        z.float()
        torch.zeros(1, device="jax").copy_(z)
    assert sum("Casting complex" in str(w.message) for w in record) == 1


def test_embedding_bag_refuses_decreasing_offsets():
    # (torch CPU fails an internal assert; a bag would start before the previous one)
    with pytest.raises(RuntimeError, match="offsets must be non-decreasing"):
        F.embedding_bag(_t([0, 1, 2], "jax"), _ones(5, 3, device="jax"), _t([0, 2, 1], "jax"))


@pytest.mark.parametrize("bad", ["input_lengths", "target_width", "concatenated"])
def test_ctc_loss_length_checks_run_inside_jit_when_asked(bad):
    log_probs = torch.randn(5, 2, 4).log_softmax(-1).to("jax")
    targets, input_lengths, target_lengths = _t([[1, 2, 3], [1, 1, 2]], "jax"), _t([5, 5], "jax"), _t([3, 3], "jax")
    if bad == "input_lengths":
        input_lengths, message = _t([6, 5], "jax"), "Expected input_lengths to have value at most 5, but got value 6"
    elif bad == "target_width":
        target_lengths, message = _t([3, 4], "jax"), "Expected tensor to have size at least 4 at dimension 1"
    else:
        targets, message = _t([1, 2, 3, 1, 1], "jax"), "Expected tensor to have size 6 at dimension 0"
    loss = t2j.jit(lambda *a: F.ctc_loss(*a, reduction="none"))
    with t2j.env(check_indices="always"), pytest.raises(RuntimeError, match=re.escape(message)):
        loss(log_probs, targets, input_lengths, target_lengths)


def test_a_lifted_python_number_is_range_checked_when_the_program_runs():
    # a number that changes from call to call becomes a program input; torch checks it fits the dtype
    x = torch.tensor([1, -3, 5], dtype=torch.int8, device="jax")
    with t2j.env(check_indices="always"):
        clamp = t2j.jit(lambda x, v: x.clamp(max=v))
        assert clamp(x, 3).tolist() == [1, -3, 3] and clamp(x, 2).tolist() == [1, -3, 2]
        with pytest.raises(RuntimeError, match="value cannot be converted to type int8_t without overflow"):
            clamp(x, -200)
    assert clamp.stats["eager_calls"] == 0
