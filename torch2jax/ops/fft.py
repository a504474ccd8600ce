"""Lowerings: the three FFT primitives every ``torch.fft`` function reaches.

``normalization`` is torch's fft_norm_mode: 0 = none, 1 = 1/sqrt(n), 2 = 1/n,
where n is the number of points of the signal (the output sizes for c2r). The
transforms themselves run unnormalized and the scale is applied afterwards.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes as _dt
from ..dispatch import TorchRuntimeError
from .registry import canonical_dims, check_values, register, scalar_type_name

aten = torch.ops.aten


def _normalize(out, n, normalization):
    if normalization == 1:
        return out * np.asarray(1 / math.sqrt(n), _dt.real_of(out.dtype))
    if normalization == 2:
        return out * np.asarray(1 / n, _dt.real_of(out.dtype))
    return out


def _check_dtype(name, x):
    if np.dtype(x.dtype) in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        raise RuntimeError(f"{name}: unsupported dtype {_dt.to_torch(x.dtype)} (torch CPU has no half-precision FFT)")


@register(aten._fft_r2c.default)
def _fft_r2c(x, dim, normalization, onesided):
    _check_dtype("_fft_r2c", x)
    axes = canonical_dims(dim, x.ndim)
    n = math.prod(x.shape[a] for a in axes)
    if onesided:
        out = jnp.fft.rfftn(x, axes=axes)
    else:
        out = jnp.fft.fftn(x.astype(_dt.complex_of(x.dtype)), axes=axes)
    return _normalize(out.astype(_dt.complex_of(x.dtype)), n, normalization)


@register(aten._fft_c2r.default)
def _fft_c2r(x, dim, normalization, last_dim_size):
    _check_dtype("_fft_c2r", x)
    axes = canonical_dims(dim, x.ndim)
    sizes = [x.shape[a] for a in axes[:-1]] + [last_dim_size]
    out = jnp.fft.irfftn(x, s=sizes, axes=axes, norm="forward")
    return _normalize(out.astype(_dt.real_of(x.dtype)), math.prod(sizes), normalization)


@register(aten._fft_c2c.default)
def _fft_c2c(x, dim, normalization, forward):
    _check_dtype("_fft_c2c", x)
    axes = canonical_dims(dim, x.ndim)
    if not axes:
        return _normalize(x, 1, normalization)
    n = math.prod(x.shape[a] for a in axes)
    out = jnp.fft.fftn(x, axes=axes) if forward else jnp.fft.ifftn(x, axes=axes, norm="forward")
    return _normalize(out.astype(x.dtype), n, normalization)


# -- istft ------------------------------------------------------------------------------
#
# aten::istft is CompositeImplicitAutograd, and its kernel checks the window's overlap-add
# envelope with a Python-bool comparison (aten::equal), which a traced program cannot
# answer. This AutogradPrivateUse1 kernel takes the same steps as torch ops (so autograd
# records them) and checks the envelope with `check_values`: at once in eager mode, when
# the program runs under check_indices="always". torch's argument checks and warnings
# come from running its own kernel on meta tensors, up to the envelope check.


def _istft_arguments_checked(x, n_fft, hop_length, win_length, window, center, normalized, onesided, length,
                             return_complex):
    """Run torch's istft on meta stand-ins: its argument errors (named for the jax device) and warnings."""
    meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
    meta_window = torch.empty(window.shape, dtype=window.dtype, device="meta") if window is not None else None
    try:
        aten.istft.default._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, meta, n_fft, hop_length,
                                  win_length, meta_window, center, normalized, onesided, length, return_complex)
    except NotImplementedError as e:  # the envelope check, reached with valid arguments
        if "aten::equal" not in str(e):
            raise
    except RuntimeError as e:
        raise TorchRuntimeError(str(e).replace("Meta", "jax")) from None


def _type_name(t):
    return f"jax{scalar_type_name(t.dtype)}Type"


def istft(x, n_fft, hop_length=None, win_length=None, window=None, center=True, normalized=False, onesided=None,
          length=None, return_complex=False):
    """The AutogradPrivateUse1 kernel of aten::istft: torch's algorithm in torch ops."""
    _istft_arguments_checked(x, n_fft, hop_length, win_length, window, center, normalized, onesided, length,
                             return_complex)
    hop = hop_length if hop_length is not None else n_fft // 4
    win = win_length if win_length is not None else n_fft

    def envelope_too_small(_):
        # torch's message shows the arguments as they were given
        shown = "None" if window is None else f"{_type_name(window)}{{{list(window.shape)}}}"
        return TorchRuntimeError(
            f"istft({_type_name(x)}{list(x.shape)}, n_fft={n_fft}, hop_length={hop}, win_length={win}, "
            f"window={shown}, center={int(center)}, normalized={int(normalized)}, "
            f"onesided={'None' if onesided is None else int(onesided)}, length={length}, "
            f"return_complex={int(return_complex)}) window overlap add min: 1\n[ jaxBoolType{{}} ]")

    batched = x.dim() == 3
    spectra = (x if batched else x.unsqueeze(0)).transpose(1, 2)  # [batch, frames, frequencies]
    full = window if window is not None else torch.ones(win, dtype=x.real.dtype, device=x.device)
    left = (n_fft - win) // 2
    full = torch.nn.functional.pad(full, (left, n_fft - win - left))
    one_sided = onesided if onesided is not None else x.shape[-2] != n_fft
    norm = "ortho" if normalized else "backward"
    if return_complex:
        frames = torch.fft.ifft(spectra, n=n_fft, dim=-1, norm=norm)
    else:
        frames = torch.fft.irfft(spectra if one_sided else spectra[..., : n_fft // 2 + 1], n=n_fft, dim=-1,
                                 norm=norm)
    count = spectra.shape[1]
    total = n_fft + hop * (count - 1)
    signal = aten.unfold_backward(frames * full.view(1, 1, n_fft), [spectra.shape[0], total], 1, n_fft, hop)
    envelope = aten.unfold_backward(full.pow(2).expand(1, count, n_fft), [1, total], 1, n_fft, hop)
    start = n_fft // 2 if center else 0
    end = start + length if length is not None else (-(n_fft // 2) if center else total)
    signal, envelope = signal[:, start:end], envelope[:, start:end]
    with jax.enable_x64(True):
        check_values(envelope.abs().min().jax(), lambda lowest: lowest < 1e-11, envelope_too_small)
    signal = signal / envelope
    if not batched:
        signal = signal.squeeze(0)
    if end > total:
        warnings.warn("The length of signal is shorter than the length parameter. Result is being padded with zeros "
                      "in the tail. Please check your center and hop_length settings.", stacklevel=2)
        signal = torch.nn.functional.pad(signal, (0, end - total))
    return signal


_library = torch.library.Library("aten", "IMPL")
_library.impl("istft", istft, "AutogradPrivateUse1")
