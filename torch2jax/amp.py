"""Automatic mixed precision on the jax device: ``torch.autocast("jax", dtype=torch.bfloat16)``.

Renaming PrivateUse1 to "jax" makes ``torch.autocast("jax")`` turn on torch's
``AutocastPrivateUse1`` dispatch key, but torch registers no kernels there: that
is left to the backend. `install` (run when torch2jax is imported) registers

* a fallthrough for every op, so ops without an autocast rule run unchanged;
* one kernel per op with a rule. It casts the floating-point jax tensors among
  the op's arguments and calls the op again with the autocast key excluded.
  The key sits above autograd, so autograd records the casts: gradients flow
  back through them and reach each parameter in the parameter's own dtype.

The rules are torch's CUDA autocast lists (the policy for accelerators, where
JAX programs run), plus the entries of torch's CPU lists that the CUDA lists do
not mention (linear algebra, FFTs, a few losses and pools in float32;
``cat`` / ``stack`` / ``index_copy`` promoted). For a float32 input, every op
therefore gets the dtype torch's CPU autocast gives it; ops that CUDA runs in
float32 but CPU leaves alone (softmax, layer_norm, exp, sum...) return float32
for a bfloat16 input, as on CUDA. Unlike torch, casts of weights are not cached
between ops: under `t2j.jit`, XLA computes each cast once anyway.
"""

from __future__ import annotations

import functools

import torch

from .device import NAME

KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

# Each entry is an ATen overload ("pow.Tensor_Scalar"; a bare name is the default overload).
# torch's named-tensor (Dimname) overloads are not listed: this torch has none.
LOWER_PRECISION = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv1d.padding", "conv2d", "conv2d.padding",
    "conv3d", "conv3d.padding", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm",
    "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "_native_multi_head_attention",
)
FP32 = (
    # torch's CUDA list
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "upsample_nearest1d.vec", "_upsample_nearest_exact1d", "_upsample_nearest_exact1d.vec",
    "upsample_nearest2d", "upsample_nearest2d.vec", "_upsample_nearest_exact2d", "_upsample_nearest_exact2d.vec",
    "upsample_nearest3d", "upsample_nearest3d.vec", "_upsample_nearest_exact3d", "_upsample_nearest_exact3d.vec",
    "upsample_linear1d", "upsample_linear1d.vec", "upsample_bilinear2d", "upsample_bilinear2d.vec",
    "_upsample_bilinear2d_aa", "_upsample_bilinear2d_aa.vec", "upsample_trilinear3d", "upsample_trilinear3d.vec",
    "upsample_bicubic2d", "upsample_bicubic2d.vec", "_upsample_bicubic2d_aa", "_upsample_bicubic2d_aa.vec",
    # torch's CPU list, where the CUDA list has no rule
    "avg_pool3d", "binary_cross_entropy", "polar", "quantile", "quantile.scalar", "nanquantile",
    "nanquantile.scalar", "stft", "stft.center", "grid_sampler_2d", "grid_sampler_3d", "trace",
    "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr",
    "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d",
    "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d", "cross_entropy_loss",
    "ctc_loss.IntList", "ctc_loss.Tensor", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn",
    "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft",
    "fft_ihfft", "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank", "linalg_matrix_rank.tol_tensor",
    "linalg_matrix_rank.atol_rtol_tensor", "linalg_matrix_rank.atol_rtol_float", "linalg_solve",
    "linalg_cholesky", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
    "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve", "geqrf", "_lu_with_info", "qr",
    "svd", "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d",
    "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig",
    "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
)
# Reductions that take a ``dtype=``: given none, they accumulate and return float32.
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# Overloads without a ``dtype=`` run as their sibling that has one, in float32.
FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
# Run in the widest floating dtype among the autocast dtype and the inputs.
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add", "stack", "cat", "index_copy",
)

_libs: list = []


def autocast(dtype: torch.dtype = torch.bfloat16, enabled: bool = True) -> torch.autocast:
    """``torch.autocast("jax", dtype=dtype, enabled=enabled)``: mixed precision on the jax device,
    eagerly and inside `t2j.jit` (a context manager and a decorator).

    >>> with t2j.amp.autocast():              # matmuls in bfloat16, softmax / norms / losses in float32
    ...     loss = F.cross_entropy(model(x), y)
    >>> loss.backward()                       # grads in the parameters' dtype (float32)
    """
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"t2j.amp.autocast: dtype must be torch.bfloat16, torch.float16 or torch.float32, "
                        f"got {dtype!r}")
    return torch.autocast(NAME, dtype=dtype, enabled=enabled)


def overload(name: str):
    """The `OpOverload` an autocast list entry names ("pow.Tensor_Scalar", "linear"), or None
    when this torch has no such op.

    >>> t2j.amp.overload("pow.Tensor_Scalar") is torch.ops.aten.pow.Tensor_Scalar
    True
    """
    packet, _, which = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet, None), which or "default", None)


def _eligible(t) -> bool:
    # float64 is left alone, as torch's autocast does.
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == NAME)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _cast(value, dtype):
    if _eligible(value):
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _run_cast(op, dtype, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
        return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})


def _lower_precision(op, *args, **kwargs):
    return _run_cast(op, torch.get_autocast_dtype(NAME), args, kwargs)


def _fp32(op, *args, **kwargs):
    return _run_cast(op, torch.float32, args, kwargs)


def _promote(op, *args, **kwargs):
    widest = torch.get_autocast_dtype(NAME)
    for t in _tensors((args, tuple(kwargs.values()))):
        if _eligible(t):
            widest = torch.promote_types(widest, t.dtype)
    return _run_cast(op, widest, args, kwargs)


def _first_tensor_eligible(args) -> bool:
    return _eligible(next(_tensors(args), None))


def _fp32_set_opt_dtype(op, *args, **kwargs):
    position = [a.name for a in op._schema.arguments].index("dtype")
    given = args[position] if len(args) > position else kwargs.get("dtype")
    if given is None and _first_tensor_eligible(args):
        args, kwargs = args[:position], {**kwargs, "dtype": torch.float32}
    with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
        return op(*args, **kwargs)


def _fp32_append_dtype(op, target, *args, **kwargs):
    if not _first_tensor_eligible(args):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)
    # The dtype sibling makes arguments with defaults (keepdim) required: fill them in.
    names = [a.name for a in op._schema.arguments]
    full = dict(zip(names, args), **kwargs)
    for a in op._schema.arguments:
        if a.name not in full and a.has_default_value():
            full[a.name] = a.default_value
    with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
        return target(**full, dtype=torch.float32)


def rules() -> dict:
    """``{OpOverload: policy name}`` for every op with an autocast rule on the jax device.

    >>> t2j.amp.rules()[torch.ops.aten.mm.default]
    'lower_precision'
    """
    table = {}
    for names, policy in ((LOWER_PRECISION, "lower_precision"), (FP32, "fp32"),
                          (FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"), (FP32_APPEND_DTYPE, "fp32_append_dtype"),
                          (PROMOTE, "promote")):
        for name in names:
            op = overload(name)
            if op is not None:
                table[op] = policy
    return table


def _entry(op) -> str:
    name = op._schema.name.split("::")[1]
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def _kernel(op, policy):
    if policy == "fp32_append_dtype":
        target = overload(FP32_APPEND_DTYPE[_entry(op)])
        return functools.partial(_fp32_append_dtype, op, target)
    return functools.partial({"lower_precision": _lower_precision, "fp32": _fp32, "promote": _promote,
                              "fp32_set_opt_dtype": _fp32_set_opt_dtype}[policy], op)


def install() -> None:
    """Register the autocast kernels of the jax device (idempotent; done by ``import torch2jax``).

    >>> t2j.amp.install()          # nothing to do: already installed on import
    """
    if _libs:
        return
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, KEY)
    impl = torch.library.Library("aten", "IMPL")
    for op, policy in rules().items():
        impl.impl(_entry(op), _kernel(op, policy), KEY)
    _libs.extend([fallback, impl])
