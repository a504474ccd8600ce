"""torch.istft on the jax device against torch CPU: values over its arguments, gradients,
torch's argument errors and the window-envelope (NOLA) check, eager and inside t2j.jit
(where torch's own kernel would stop the trace at its Python-bool check)."""

from __future__ import annotations

import itertools
import re
import warnings

import pytest
import torch

import torch2jax as t2j


def _jax(v):
    return v.to("jax") if isinstance(v, torch.Tensor) else v


def _signal():
    return torch.randn(2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def _spectrum(n_fft, hop, win, window, center, normalized, onesided, return_complex):
    sig = _signal().to(torch.complex128) if return_complex else _signal()
    return torch.stft(sig, n_fft, hop, win, window, center=center, normalized=normalized,
                      onesided=not return_complex and onesided is not False, return_complex=True)


_GRID = [args for args in itertools.product((4, 5), (None, 12), (True, False), (False, True), (None, False),
                                            (None, 50, 80), (False, True), (True, False))
         if not (args[6] and args[4] is None)][::5]  # a spread of the combinations


@pytest.mark.parametrize("hop,win,center,normalized,onesided,length,return_complex,hann", _GRID)
def test_istft_like_torch(hop, win, center, normalized, onesided, length, return_complex, hann):
    n_fft = 16
    window = torch.hann_window(win or n_fft, dtype=torch.float64) if hann else None
    spec = _spectrum(n_fft, hop, win, window, center, normalized, onesided, return_complex)
    kwargs = dict(n_fft=n_fft, hop_length=hop, win_length=win, window=window, center=center, normalized=normalized,
                  onesided=onesided, length=length, return_complex=return_complex)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            expected, error = torch.istft(spec, **kwargs), None
        except RuntimeError as e:
            expected, error = None, str(e)
        jax_kwargs = {k: _jax(v) for k, v in kwargs.items()}
        if error is not None:
            # torch's message, with the jax device's type names
            error = re.sub(r"torch\.(\w+)Tensor", r"jax\1Type", error.replace("CPU", "jax"))
            with pytest.raises(RuntimeError, match=re.escape(error)):
                torch.istft(spec.to("jax"), **jax_kwargs)
            return
        got = torch.istft(spec.to("jax"), **jax_kwargs)
        jitted = t2j.jit(lambda s: torch.istft(s, **jax_kwargs))
        compiled = jitted(spec.to("jax"))
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close(compiled.cpu(), expected)
    assert jitted.stats["eager_calls"] == 0, "the trace stopped: it ran eagerly"


def test_istft_warns_like_torch():
    spec = torch.stft(_signal(), 16, 4, return_complex=True, window=torch.ones(16, dtype=torch.float64))
    with pytest.warns(UserWarning, match="Result is being padded with zeros in the tail"):
        out = torch.istft(spec.to("jax"), 16, 4, window=torch.ones(16, dtype=torch.float64, device="jax"), length=80)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.istft(spec, 16, 4, window=torch.ones(16, dtype=torch.float64), length=80)
    torch.testing.assert_close(out.cpu(), expected)


def test_istft_gradients_like_torch():
    x = torch.randn(9, 5, dtype=torch.complex128, requires_grad=True)
    w = torch.hann_window(16, dtype=torch.float64, requires_grad=True)
    torch.istft(x, 16, 4, window=w).pow(2).sum().backward()
    xj, wj = x.detach().to("jax").requires_grad_(), w.detach().to("jax").requires_grad_()
    torch.istft(xj, 16, 4, window=wj).pow(2).sum().backward()
    torch.testing.assert_close(xj.grad.cpu(), x.grad)
    torch.testing.assert_close(wj.grad.cpu(), w.grad)


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_fft=16), "istft requires a complex-valued input tensor"),
    (dict(n_fft=10, onesided=False), "expected the frequency dimension (3rd to the last) of the input tensor to "
                                     "match n_fft when onesided=False, but got 9"),
    (dict(n_fft=16, win_length=20), "expected 0 < win_length <= n_fft"),
])
def test_istft_argument_errors_like_torch(kwargs, message):
    spec = torch.randn(9, 5, dtype=torch.complex64)
    if "win_length" not in kwargs and kwargs.get("n_fft") == 16:
        spec = spec.real
    for device in ("cpu", "jax"):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            torch.istft(spec.to(device), **kwargs)


def test_istft_window_envelope_check():
    spec = torch.randn(9, 5, dtype=torch.complex64)
    window = torch.zeros(16)
    for device in ("cpu", "jax"):
        with pytest.raises(RuntimeError, match="window overlap add min"):
            torch.istft(spec.to(device), 16, 4, window=window.to(device))
    jitted = t2j.jit(lambda s, w: torch.istft(s, 16, 4, window=w))
    assert torch.isnan(jitted(spec.to("jax"), window.to("jax"))).all()  # not checked in the program: 0 / 0
    with t2j.env(check_indices="always"), pytest.raises(RuntimeError, match="window overlap add min"):
        jitted(spec.to("jax"), window.to("jax"))
