"""complex32 (torch.chalf) on the jax device against torch CPU: held as complex64 with
float16 parts (torch2jax/complex32.py), it must behave as torch's complex32 does."""

import copy
import io

import pytest
import torch

import torch2jax as t2j
from torch2jax.complex32 import Complex32Tensor


@pytest.fixture(autouse=True)
def _env():
    with t2j.env():
        yield


def _chalf():
    torch.manual_seed(0)
    return (torch.randn(3, 4) + 1j * torch.randn(3, 4)).chalf()


def _same(ours, theirs):
    assert isinstance(ours, torch.Tensor) and ours.device.type == "jax"
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    host = ours.cpu()
    assert host.dtype == theirs.dtype
    # bit for bit: both round the exact (complex64) result to float16 parts once
    wide = torch.complex64 if theirs.is_complex() else torch.float32
    torch.testing.assert_close(host.to(wide), theirs.to(wide), atol=0, rtol=0)


PROGRAMS = {
    "add": lambda x: x + x * (0.5 - 1j),
    "mul by float scalar": lambda x: x * 2.5,
    "add float16": lambda x: x + x.real,
    "add complex64 promotes": lambda x: x + x.to(torch.cfloat),
    "abs is float16": lambda x: x.abs(),
    "sgn": lambda x: x.sgn(),
    "eq": lambda x: x == x.conj(),
    "where": lambda x: torch.where(x.real > 0, x, 0),
    "masked_fill": lambda x: x.masked_fill(x.imag > 0, 5 + 1j),
    "cat mixed": lambda x: torch.cat([x, x.to(torch.cfloat)]),
    "transpose clone": lambda x: x.t().clone(),
    "index_select": lambda x: x.index_select(1, torch.tensor([3, 0], device=x.device)),
    "view write": lambda x: (x[:, 1].mul_(2 + 1j), x)[1],
    "transposed view add_": lambda x: (x.t().add_(1 + 1j), x)[1],
    "real view write": lambda x: (x.real.fill_(3), x)[1],
    "view_as_real write": lambda x: (torch.view_as_real(x)[..., 1].mul_(3), x)[1],
    "view_as_real": lambda x: torch.view_as_real(x) * 2,
    "imag": lambda x: x.imag,
    "copy_ rounds complex64": lambda x: x.copy_(torch.full_like(x, 1.0001 + 2j, dtype=torch.cfloat)),
    "copy_ into complex64": lambda x: torch.zeros(3, 4, dtype=torch.cfloat, device=x.device).copy_(x),
    "index_put_": lambda x: x.index_put_((torch.tensor([0, 2], device=x.device),), torch.ones(4, dtype=torch.chalf, device=x.device)),
    "to complex64": lambda x: x.to(torch.cfloat),
    "empty_like dtype": lambda x: torch.zeros_like(x),
    "view float16": lambda x: x.view(torch.float16),
    "view int32 written": lambda x: (x.view(torch.int32)[0].zero_(), x)[1],
    "view back from float16": lambda x: x.view(torch.float16).view(torch.complex32),
    "0-dim view float32": lambda x: x[1, 2].view(torch.float32),
    "fftshift": lambda x: torch.fft.fftshift(x),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program(name):
    f = PROGRAMS[name]
    expected = f(_chalf())
    ours = f(_chalf().to("jax"))
    _same(ours, expected)


@pytest.mark.parametrize("name,f", [
    ("h * 1j", lambda h: h * 1j),
    ("view_as_complex", lambda h: torch.view_as_complex(h.reshape(2, 2))),
    ("complex", lambda h: torch.complex(h, -h)),
    ("chalf", lambda h: h.chalf()),
    ("view complex32", lambda h: h.view(torch.complex32)),
])
def test_float16_made_complex(name, f):
    h = torch.tensor([1.5, -2.25, 0.1, 3.0], dtype=torch.half)
    _same(f(h.to("jax")), f(h))


def test_view_as_complex_of_float16_is_a_view():
    h = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.half, device="jax")
    z = torch.view_as_complex(h)
    z.mul_(1j)
    assert h.cpu().tolist() == [[-2.0, 1.0], [-4.0, 3.0]]


def test_factories_and_transfers():
    z = torch.zeros(2, 3, dtype=torch.chalf, device="jax")
    assert type(z) is Complex32Tensor and z.dtype == torch.complex32
    x = _chalf()
    moved = x.to("jax")
    _same(moved, x)
    assert moved[0, 0].item() == x[0, 0].item()
    assert moved.tolist() == x.tolist()
    assert moved.jax().dtype == "complex64"


def test_copy_into_cpu_complex32():
    target = torch.zeros(3, 4, dtype=torch.chalf)
    target.copy_(_chalf().to("jax"))
    assert torch.equal(target.to(torch.cfloat), _chalf().to(torch.cfloat))


def test_values_stay_complex32_values():
    x = torch.tensor([1 + 1j], dtype=torch.chalf, device="jax")
    x.mul_(1.0001)  # 1.0001 rounds to 1.0 in float16
    assert x.jax().tolist() == [1 + 1j]
    assert (x * 1.0001).jax().tolist() == [1 + 1j]


def test_repr_deepcopy_save_load():
    x = _chalf().to("jax")
    assert "dtype=torch.complex32" in repr(x) and "device='jax:0'" in repr(x)
    clone = copy.deepcopy(x)
    assert type(clone) is Complex32Tensor
    _same(clone, _chalf())
    buffer = io.BytesIO()
    torch.save({"x": x, "row": x[1]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded["x"].dtype == torch.complex32 and loaded["x"].device.type == "jax"
    _same(loaded["row"], _chalf()[1])
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu")
    assert on_cpu["x"].dtype == torch.complex32 and torch.equal(on_cpu["x"].to(torch.cfloat), _chalf().to(torch.cfloat))


def test_view_dtype_errors_as_torch():
    x = _chalf()
    for arg in (x, x.to("jax")):
        with pytest.raises(RuntimeError, match="stride\\(-1\\) must be 1"):
            arg.t().view(torch.float16)
        with pytest.raises(RuntimeError, match="cannot be 0"):
            arg[0, 0].view(torch.float16)


def test_jit():
    x = _chalf()

    @t2j.jit
    def step(z, s):
        s.mul_(2)
        return (z * (1 - 1j)).t(), z.abs()

    s = x.to("jax")
    out, mag = step(x.to("jax"), s)
    _same(out, (x * (1 - 1j)).t())
    _same(mag, x.abs())
    _same(s, x * 2)
    out, _ = step(x.to("jax"), s)  # the compiled program, called again
    _same(s, x * 4)
    assert type(out) is Complex32Tensor


def test_jitted_view_of_an_offset_input_view():
    """A jitted function returning a view of its input, itself a view into a larger storage:
    the view is rebuilt over the input after the call (its int64 view steps under x64)."""
    base = torch.randn(20, dtype=torch.complex64).to(torch.complex32)
    expected = torch.as_strided(base[5:15], (2, 2), (1, 2))
    got = t2j.jit(lambda z: torch.as_strided(z, (2, 2), (1, 2)))(base.to("jax").as_strided((10,), (1,), 5))
    _same(got, expected)
    assert type(got) is Complex32Tensor
