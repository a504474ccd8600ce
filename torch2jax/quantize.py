"""Int8 weight-only quantization: `int8_weight_only(model)`.

Each ``nn.Linear`` (and Hugging Face's ``Conv1D``, GPT-2's transposed linear)
keeps its weight as int8 with one float scale per output channel (symmetric:
``w ≈ q * scale``, ``q`` in [-127, 127]). The module is changed in place: its
class becomes `Int8Linear` / `Int8Conv1D`, the float ``weight`` parameter is
replaced by an int8 ``weight`` buffer and a ``weight_scale`` buffer, so
``state_dict()`` holds exactly what is stored. No float copy of the weight is
kept: the forward converts the int8 weight inside the matmul and applies the
scale to the (much smaller) result, ``(x @ q.T) * scale + bias``, which under
`t2j.jit` is one convert + dot + multiply that XLA fuses.

The forward is plain torch, so a quantized module runs on the CPU as well as on
the jax device, under autograd (gradients reach the inputs and the bias), under
`t2j.jit` / `t2j.compile` and under autocast.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

_QMAX = 127


def quantize_per_channel(weight: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of ``weight`` with one scale per index of ``dim``.

    Returns ``(q, scale)``: ``q`` int8 of ``weight``'s shape, ``scale`` of
    ``weight``'s dtype and shape ``[weight.shape[dim]]``, with
    ``q * scale`` (broadcast along ``dim``) ≈ ``weight``. A channel that is all
    zeros gets scale 1.

    >>> q, s = t2j.quantize.quantize_per_channel(linear.weight)   # per output channel
    >>> w = q.float() * s[:, None]
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"t2j.quantize.quantize_per_channel: weight must be a floating-point tensor, got {got}")
    if weight.dim() != 2:
        raise ValueError(f"t2j.quantize.quantize_per_channel: weight must be 2-D, got shape {tuple(weight.shape)}")
    with torch.no_grad():
        w = weight.detach()
        amax = w.abs().amax(dim=1 - dim)
        scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
        q = torch.clamp(torch.round(w / scale.unsqueeze(1 - dim)), -_QMAX, _QMAX).to(torch.int8)
    return q, scale


class Int8Linear(nn.Linear):
    """An ``nn.Linear`` whose weight is int8 (buffer ``weight``, shape [out, in]) with
    per-output-channel scales (buffer ``weight_scale``, shape [out]). Made by
    `int8_weight_only`; ``isinstance(m, nn.Linear)`` still holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(self.weight_scale.dtype))
        return _scale_and_bias(y, self.weight_scale, self.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _check_loaded_weight(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Int8Conv1D(nn.Module):
    """Hugging Face's ``Conv1D`` (weight [in, out], ``x @ w + b``) with an int8 weight
    and one scale per output column (buffer ``weight_scale``, shape [out]).
    Made by `int8_weight_only`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight.to(self.weight_scale.dtype))
        return _scale_and_bias(y, self.weight_scale, self.bias)

    def __repr__(self) -> str:
        return f"Int8Conv1D(nf={self.nf}, nx={self.nx})"

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _check_loaded_weight(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _scale_and_bias(y, scale, bias):
    # Cast to y's dtype so that, as for a float linear, autocast's bfloat16 result stays bfloat16.
    y = y * scale.to(y.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def _check_loaded_weight(module, state_dict, prefix):
    # copy_ would silently truncate a float weight into the int8 buffer.
    w = state_dict.get(prefix + "weight")
    if isinstance(w, torch.Tensor) and w.dtype != torch.int8:
        raise TypeError(f"{type(module).__name__}.load_state_dict: {prefix}weight is {w.dtype}, expected the int8 "
                        "weight of a quantized model; load float weights before t2j.quantize.int8_weight_only")


def _hf_conv1d():
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def _kind(module):
    """"linear" / "conv1d" for a module this file quantizes, else None."""
    if isinstance(module, (Int8Linear, Int8Conv1D)):
        return None
    if isinstance(module, nn.Linear):
        return "linear"
    conv1d = _hf_conv1d()
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d"
    return None


def _shared_weights(model) -> set:
    """ids of parameters that more than one module holds (GPT-2's tied embedding / head)."""
    seen, shared = set(), set()
    for module in model.modules():
        for p in module._parameters.values():
            if p is None:
                continue
            if id(p) in seen:
                shared.add(id(p))
            seen.add(id(p))
    return shared


def _quantize_module(module, kind):
    weight = module.weight
    # Conv1D stores [in, out]: its output channels are the columns.
    q, scale = quantize_per_channel(weight, dim=0 if kind == "linear" else 1)
    del module.weight
    module.__class__ = Int8Linear if kind == "linear" else Int8Conv1D
    module.register_buffer("weight", q)
    module.register_buffer("weight_scale", scale)


def int8_weight_only(model: nn.Module, *, filter_fn=None) -> nn.Module:
    """Quantize the weights of ``model``'s linear layers to int8, in place, and return ``model``.

    Every ``nn.Linear`` (and Hugging Face ``Conv1D``) for which
    ``filter_fn(module, qualified_name)`` is true (default: all) becomes an
    `Int8Linear` / `Int8Conv1D`: int8 weight, per-output-channel scales, same
    bias. A weight tied to another module (an LM head sharing the embedding
    matrix) is left in float: quantizing it would store a second copy. Works
    before or after ``model.to("jax")``; the quantized model runs eagerly,
    under `t2j.jit` and `t2j.compile`.

    >>> model = t2j.quantize.int8_weight_only(model.to("jax"))
    >>> logits = model(ids)                  # int8 weights, float activations
    >>> model.state_dict()["lm_head.weight"].dtype
    torch.int8
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"t2j.quantize.int8_weight_only: model must be a torch.nn.Module, got {type(model).__name__}")
    shared = _shared_weights(model)
    targets = []
    for name, module in model.named_modules():
        kind = _kind(module)
        if kind is None or (filter_fn is not None and not filter_fn(module, name)):
            continue
        weight = module.weight
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise TypeError(f"t2j.quantize.int8_weight_only: {name or type(module).__name__}.weight must be a "
                            f"floating-point tensor, got {got}")
        if weight.device.type == "meta":
            raise ValueError(f"t2j.quantize.int8_weight_only: {name or type(module).__name__}.weight is on the meta "
                             "device; materialize the model (load its weights) first")
        if id(weight) not in shared:
            targets.append((module, kind))
    if not targets:
        raise ValueError(f"t2j.quantize.int8_weight_only: {type(model).__name__} has no nn.Linear to quantize "
                         "(none found, all already quantized, tied to another module or excluded by filter_fn)")
    for module, kind in targets:
        _quantize_module(module, kind)
    return model


def nbytes(model: nn.Module) -> int:
    """Bytes held by ``model``'s parameters and buffers (each tensor counted once).

    >>> t2j.quantize.nbytes(model)
    """
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
