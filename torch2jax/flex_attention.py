"""``torch.nn.attention.flex_attention.flex_attention`` on jax tensors.

torch's function refuses devices other than its own ("FlexAttention is only supported on
CUDA, CPU, HPU, or MPS devices") and compiles its operator with Dynamo, which does not trace
a tensor without dense storage. On jax tensors it runs here instead, with torch's semantics
(those of its CPU implementation, ``math_attention``): the scores ``q @ k^T * scale`` in
float32 (float64 for float64 inputs), ``score_mod`` and the block mask's ``mask_mod``
applied to every (batch, head, query, key) position, masked positions ``-inf``, a softmax
that gives fully masked rows zeros, and the log-sum-exp and row maxima it can return.

``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` run once, on
the whole score tensor and on index tensors shaped to broadcast against it (``b`` is
``(B, 1, 1, 1)``, ``kv_idx`` is ``(1, 1, 1, KV)``), where torch calls them per position
through ``torch.vmap``: the elementwise functions FlexAttention is written with (``score +
bias[h]``, ``torch.where(q_idx >= kv_idx, score, -inf)``, ``rel_bias[q_idx - kv_idx]``) give
the same values. Everything is torch ops on jax tensors, so autograd reaches the inputs and
the tensors ``score_mod`` closes over (a learned bias), and `t2j.jit` traces it into its
program. The block mask's block structure is an optimization torch's CPU code ignores, as
this does: its ``mask_mod`` decides.

    >>> from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    >>> q = k = v = torch.randn(1, 2, 128, 16, device="jax")
    >>> causal = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 128, 128, device="jax")
    >>> flex_attention(q, k, v, block_mask=causal).shape
    torch.Size([1, 2, 128, 16])
"""

from __future__ import annotations

import inspect
import math
import types

import torch

from .device import holds_jax_tensor


def install_flex_attention() -> None:
    """Route ``flex_attention`` of jax tensors to `flex_attention`, and have ``create_block_mask``
    build masks for the jax device uncompiled (transformers asks for ``_compile=True``, which would
    have inductor generate code for the device). Called on import.

    torch's function objects themselves take these routes (their code is replaced, `_reroute`), so
    that code which bound their names before importing torch2jax (``from torch.nn.attention.flex_attention
    import flex_attention``, transformers' integration) takes them too."""
    import torch.nn.attention.flex_attention as module

    _reroute(module.flex_attention, _FLEX_ATTENTION_ROUTE, _t2j_flex_attention=flex_attention,
             _t2j_holds_jax_tensor=holds_jax_tensor())
    _reroute(module.create_block_mask, _CREATE_BLOCK_MASK_ROUTE)


def _reroute(function, source: str, **names) -> None:
    """Give torch's ``function`` the code of the function ``source`` defines, which calls the original
    as ``_t2j_original_<name>``; ``names`` join the original's module globals, where the new code's
    names resolve. The code is compiled from ``source``, so it belongs to no file Dynamo skips: Dynamo
    traces it, and torch's own code behind it, as it traced the original. A torch whose signature
    differs from ``source``'s keeps its function."""
    name = function.__name__
    if f"_t2j_original_{name}" in function.__globals__:
        return
    namespace = {}
    exec(compile(source, f"<torch2jax: {name} on the jax device>", "exec"), namespace)  # noqa: S102
    routed = namespace[name]
    if list(inspect.signature(routed).parameters) != list(inspect.signature(function).parameters):
        return
    original = types.FunctionType(function.__code__, function.__globals__, name, function.__defaults__,
                                  function.__closure__)
    original.__kwdefaults__ = function.__kwdefaults__
    function.__globals__.update(names, **{f"_t2j_original_{name}": original})
    function.__code__ = routed.__code__


# A jax tensor (an opaque object to Dynamo, a fake tensor on the jax device under torch2jax's backend)
# goes to torch2jax's function, which Dynamo does not trace (a graph break); others to torch's code.
_FLEX_ATTENTION_ROUTE = """
def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    if _t2j_holds_jax_tensor((query, key, value)):
        route = _t2j_flex_attention
    else:
        route = _t2j_original_flex_attention
    return route(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                 return_aux=return_aux)
"""

_CREATE_BLOCK_MASK_ROUTE = """
def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False,
                      separate_full_blocks=True, compute_dq_write_order=False, dq_kv_order=True):
    if device is not None and torch.device(device).type == "jax":
        _compile = False
    return _t2j_original_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, _compile,
                                           separate_full_blocks, compute_dq_write_order, dq_kv_order)
"""


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch's ``flex_attention`` (same arguments and results) computed with torch ops on jax tensors;
    ``kernel_options`` choose among torch's GPU kernels and are ignored."""
    import torch.nn.attention.flex_attention as module

    _check_arguments(module, query, key, value, block_mask, enable_gqa, return_lse, return_aux)
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    mask_mod = None if block_mask is None else block_mask.mask_mod
    if mask_mod is module.noop_mask:
        mask_mod = None
    out, lse, max_scores = _attention(query, key, value, score_mod, mask_mod, scale)
    want_lse = return_lse or return_aux is not None and return_aux.lse
    lse = lse if want_lse and lse.numel() > 0 else None
    if return_aux is not None:
        max_scores = max_scores if return_aux.max_scores and max_scores.numel() > 0 else None
        return out, module.AuxOutput(lse=lse, max_scores=max_scores)
    if return_lse:
        module._warn_once("deprecated_return_lse", "return_lse is deprecated and will be removed in v2.10. "
                          "Please use return_aux=AuxRequest(lse=True) instead.", category=FutureWarning)
        return out, lse
    return out


def _check_arguments(module, query, key, value, block_mask, enable_gqa, return_lse, return_aux):
    """torch's checks of ``flex_attention``'s arguments, with its messages (its device check aside)."""
    module._validate_no_nested_tensors(query, key, value)
    module._validate_sdpa_input(query, key, value, allow_lowp_kv=True)
    module._validate_embed_dim(query, key, value)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise NotImplementedError("NYI: query, key, and value must be 4D tensors")
    hq, hkv = query.size(1), key.size(1)
    if not enable_gqa and hq != hkv:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={hq} and "
                         f"Hkv={hkv}. Try setting enable_gqa=True for GQA.")
    if enable_gqa and hq % hkv != 0:
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got Hq={hq} "
                         f"and Hkv={hkv}.")
    bq, bkv = query.size(0), key.size(0)
    if bq != bkv:
        if block_mask is None:
            raise ValueError(f"Expect query and key/value to have the same batch size, or non-none block_mask, "
                             f"but got block_mask=None, Bq={bq}, and Bkv={bkv}.")
        if block_mask.kv_num_blocks.size(0) != bq:
            raise ValueError(f"Expect query and key/value to have the same batch size, or block_mask and query "
                             f"to have the same batch size, but got Bq={bq}, Bkv={bkv}, "
                             f"B_block_mask={block_mask.kv_num_blocks.size(0)}.")
    if not (bq == bkv or bkv == 1):
        raise RuntimeError(f"Bq and Bkv must broadcast. Got Bq={bq} and Bkv={bkv}")
    if block_mask is not None:
        _check_block_mask(module, block_mask, query.size(-2), key.size(-2))
    if return_lse and return_aux is not None:
        raise ValueError("Cannot specify both return_lse and return_aux. return_lse is deprecated, please use "
                         "return_aux=AuxRequest(lse=True) instead.")


def _check_block_mask(module, block_mask, q_len, kv_len):
    if getattr(block_mask, "mask_mod", None) is module._sliced_mask_mod_error:
        raise RuntimeError("Cannot use mask_mod from a sliced BlockMask")
    if block_mask.BLOCK_SIZE == (module._LARGE_SPARSE_BLOCK_SIZE,) * 2:  # (a mask that masks nothing)
        return
    mq, mkv = block_mask.shape[-2], block_mask.shape[-1]
    if q_len > mq or kv_len > mkv:
        raise ValueError(
            f"block_mask was created for block_mask.shape={block_mask.shape} but got q_len={q_len} and "
            f"kv_len={kv_len}. As the block mask was created for a smaller length than you're using it for, you "
            "likely need to create a new block mask.")
    if q_len < mq or kv_len < mkv:
        raise ValueError(
            f"block_mask was created for block_mask.shape={block_mask.shape} but got q_len={q_len} and "
            f"kv_len={kv_len}. As the block mask was created for a larger length than you're using it for, you "
            "can either 1. create a new block mask with the correct length, or 2. 'adjust' the existing block "
            "mask to the correct length by calling block_mask._adjust(q_len, kv_len). This essentially 'crops' "
            "the block mask to the upper left corner, which does not work for all mask_mods!")


def _attention(query, key, value, score_mod, mask_mod, scale):
    """(output laid out as ``query``, log-sum-exp, row maxima) of the attention, as torch's CPU
    implementation computes them."""
    groups = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    key = key.expand(query.size(0), *key.shape[1:])
    value = value.expand(query.size(0), *value.shape[1:])
    working = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = (query.to(working) @ key.to(working).transpose(-2, -1) * scale).to(working)
    b, h, q_idx, kv_idx = (torch.arange(n, device=query.device).view([-1 if d == k else 1 for d in range(4)])
                           for k, n in enumerate(scores.shape))
    modded = scores if score_mod is None else score_mod(scores, b, h, q_idx, kv_idx)
    keep = True if mask_mod is None else mask_mod(b, h, q_idx, kv_idx)
    modded = torch.where(torch.as_tensor(keep, device=query.device), modded,
                         torch.tensor(-math.inf, dtype=working, device=query.device)).expand(scores.shape)
    lse = modded.logsumexp(-1)
    lse = torch.where((modded == -math.inf).all(-1), -math.inf, lse)
    max_scores = modded.max(-1).values
    out = torch._safe_softmax(modded, -1).to(query.dtype) @ value.to(query.dtype)
    return _laid_out_as(out, query), lse, max_scores


def _laid_out_as(out, query):
    """``out`` with its dimensions stored in the order of ``query``'s (a ``(B, S, H, D)`` tensor's
    ``transpose(1, 2)`` gives a result stored ``(B, S, H, D)`` too, as torch's), the last innermost."""
    order = sorted(range(3), key=lambda d: -query.stride(d)) + [3]
    if order == [0, 1, 2, 3]:
        return out
    inverse = sorted(range(4), key=order.__getitem__)
    return out.permute(order).contiguous().permute(inverse)
