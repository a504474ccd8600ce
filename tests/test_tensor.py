"""The jax device and torch2jax.Tensor: creation, conversion, printing, saving, env."""

from __future__ import annotations

import io
import pickle
import threading
import warnings

import jax
import numpy as np
import pytest
import torch

import torch2jax as t2j


def test_factories_on_jax_device():
    x = torch.randn(4, 8, device="jax")
    assert isinstance(x, t2j.Tensor) and x.device.type == "jax" and x.shape == (4, 8)
    assert isinstance(x.jax(), jax.Array) and x.jax().shape == (4, 8)
    assert torch.zeros(2, device="jax").jax().tolist() == [0.0, 0.0]
    assert torch.tensor([1, 2], device="jax").dtype == torch.int64
    assert torch.arange(5, device="jax").dtype == torch.int64
    assert torch.full((2,), 3, device="jax").dtype == torch.int64


def test_conversions_round_trip():
    cpu = torch.randn(3, 5)
    x = cpu.to("jax")
    assert isinstance(x, t2j.Tensor)
    torch.testing.assert_close(x.cpu(), cpu)
    assert type(x.cpu()) is torch.Tensor
    np.testing.assert_allclose(x.numpy(), cpu.numpy())
    assert torch.tensor(2.5, device="jax").item() == 2.5
    assert torch.tensor([[1, 2], [3, 4]], device="jax").tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_dtypes_round_trip(dtype):
    cpu = (torch.randn(4, 3) * 10).to(dtype)
    x = cpu.to("jax")
    assert x.dtype == dtype
    assert torch.equal(x.cpu(), cpu)


def test_int64_is_exact():
    x = torch.tensor([2**40], device="jax") + 1
    assert x.dtype == torch.int64 and x.item() == 2**40 + 1
    assert torch.tensor([2**62], device="jax").cpu().item() == 2**62


def test_jax_code_in_the_same_process_keeps_32_bit_defaults():
    torch.ones(2, dtype=torch.float64, device="jax") * 2
    assert jax.numpy.ones(3).dtype == np.float32
    assert jax.numpy.arange(3).dtype == np.int32


def test_repr_and_print():
    x = torch.tensor([1.0, 2.0], device="jax")
    assert repr(x) == "tensor([1., 2.], device='jax:0')"
    y = x.clone().requires_grad_()
    assert "requires_grad=True" in repr(y)
    assert "grad_fn=" in repr(y * 2)
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ours = torch.nn.Parameter(x.clone())
    assert repr(ours) == repr(param).replace(", requires_grad", ", device='jax:0', requires_grad")


def test_format_spec_like_torch():
    for value in (torch.tensor(2.3456), torch.tensor(7), torch.tensor(True)):
        ours = value.to("jax")
        for spec in ("", ".2f", ">8", "e") if value.is_floating_point() else ("",):
            assert format(ours, spec) == format(value, spec), (value, spec)
    assert format(torch.tensor([1.5, 2.0], device="jax")) == repr(torch.tensor([1.5, 2.0], device="jax"))
    loss = torch.tensor(0.123456, device="jax", requires_grad=True) * 2
    assert f"loss {loss:.3f}" == "loss 0.247"
    with pytest.raises(TypeError):
        format(torch.tensor([1.5, 2.0], device="jax"), ".2f")


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_the_class_of_a_parameter_makes_a_parameter(device):
    # (accelerate's ``param_cls = type(module._parameters[name]); param_cls(new, requires_grad=old.requires_grad)``:
    # a jax parameter's class is the plain jax tensor's, whose constructor took only torch2jax's storages)
    m = torch.nn.Linear(2, 2).to(device)
    cls, new = type(m.weight), torch.full((2, 2), 3.0, device=device)
    made = [cls(new, requires_grad=False), cls(new, False), cls(new), cls(new.cpu(), requires_grad=False).to(device)]
    assert [(isinstance(p, torch.nn.Parameter), p.requires_grad, p.device.type) for p in made] == [
        (True, False, device), (True, False, device), (True, True, device), (device == "cpu", False, device)]
    m._parameters["weight"] = made[0]
    torch.testing.assert_close(m(torch.ones(1, 2, device=device)).cpu(),
                               torch.ones(1, 2) @ torch.full((2, 2), 3.0) + m.bias.detach().cpu())


def test_module_to_jax_and_back():
    m = torch.nn.Linear(3, 2)
    ref = m(torch.ones(1, 3))
    m.to("jax")
    assert isinstance(m.weight, t2j.Tensor) and isinstance(m.weight, torch.nn.Parameter)
    out = m(torch.ones(1, 3, device="jax"))
    torch.testing.assert_close(out.cpu(), ref.detach())
    m.to("cpu")
    assert type(m.weight.data) is torch.Tensor


def test_torch_save_and_pickle():
    x = torch.randn(3, 2, device="jax")
    buf = io.BytesIO()
    torch.save({"w": x, "n": 3}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert isinstance(loaded["w"], t2j.Tensor)
    torch.testing.assert_close(loaded["w"].cpu(), x.cpu())
    again = pickle.loads(pickle.dumps(x))
    torch.testing.assert_close(again.cpu(), x.cpu())


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_save_load_of_torch_newer_dtypes(dtype):
    # torch pickles these through _rebuild_tensor_v3, not v2: they must come back on the jax device too
    x = torch.arange(6).to(dtype).to("jax")
    buf = io.BytesIO()
    torch.save({"x": x, "tail": x[2:]}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert isinstance(loaded["x"], t2j.Tensor) and isinstance(loaded["tail"], t2j.Tensor)
    assert loaded["x"].dtype == dtype
    assert loaded["tail"].cpu().to(torch.float32).tolist() == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_save_load_keeps_conjugate_and_negative_view_bits_over_a_shared_storage(device):
    def round_trip(obj, **kwargs):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, **kwargs)

    x = torch.tensor([1 + 2j, 3 - 1j, 5 + 0.5j], device=device)
    base, conj, tail = round_trip((x, x.conj(), x[1:].conj()))
    assert conj.is_conj() and tail.is_conj() and conj.device == x.device
    assert conj.cpu().resolve_conj().tolist() == [1 - 2j, 3 + 1j, 5 - 0.5j]
    base.add_(1j)  # the views are still views of the loaded base
    assert tail.cpu().resolve_conj().tolist() == [3 + 0j, 5 - 1.5j]
    neg = round_trip(x.conj().imag)
    assert neg.is_neg() and neg.cpu().resolve_neg().tolist() == [-2.0, 1.0, -0.5]
    on_cpu = round_trip(x.conj(), map_location="cpu", weights_only=True)
    assert on_cpu.device.type == "cpu" and on_cpu.is_conj() and on_cpu.resolve_conj().tolist()[0] == 1 - 2j


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_save_load_keeps_a_view_holding_nan_a_view(device):
    x = torch.tensor([1.0, float("nan"), 3.0, 4.0], device=device)
    buf = io.BytesIO()
    torch.save({"x": x, "v": x[1:3]}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    loaded["v"].fill_(7.0)
    assert loaded["x"].cpu().tolist() == [1.0, 7.0, 7.0, 4.0]


def test_load_onto_a_jax_device_that_does_not_exist_is_refused():
    buf = io.BytesIO()
    torch.save(torch.ones(2), buf)
    buf.seek(0)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.load(buf, map_location="jax:1")
    buf.seek(0)
    assert torch.load(buf, map_location="jax:0").device == torch.device("jax", 0)


def test_storage_of_a_jax_tensor_is_a_storage_torch_save_writes():
    x = torch.arange(4.0, device="jax")
    assert torch.is_storage(x.untyped_storage()) and not torch.is_storage(x)
    for weights_only in (True, False):
        buf = io.BytesIO()
        torch.save(x.untyped_storage(), buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=weights_only)
        assert bytes(loaded.untyped()) == bytes(torch.arange(4.0).untyped_storage())


def test_state_dict_save_load():
    m = torch.nn.Linear(4, 4).to("jax")
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    m2 = torch.nn.Linear(4, 4).to("jax")
    m2.load_state_dict(torch.load(buf))
    torch.testing.assert_close(m2.weight.cpu(), m.weight.cpu())


def test_env_is_scoped_reentrant_and_thread_local():
    assert t2j.config().fallback == "warn"
    with t2j.env(fallback="error"):
        with t2j.env(check_indices=False):
            assert t2j.config().fallback == "error" and not t2j.config().check_indices
            seen = []
            th = threading.Thread(target=lambda: seen.append(t2j.config().fallback))
            th.start()
            th.join()
            assert seen == ["warn"]
        assert t2j.config().check_indices
    assert t2j.config().fallback == "warn"


def test_enable_disable_global():
    t2j.enable(fallback="silent")
    try:
        assert t2j.config().fallback == "silent" and t2j.env is not None
    finally:
        t2j.disable()
    assert t2j.config().fallback == "warn"


def test_bad_config_value():
    with pytest.raises(ValueError, match="fallback"):
        with t2j.env(fallback="sometimes"):
            pass


def test_torch_compile_still_works_after_import():
    f = torch.compile(lambda a: a.sin() + 1, backend="eager")
    torch.testing.assert_close(f(torch.ones(3)), torch.ones(3).sin() + 1)


def test_data_setter_replaces_value():
    x = torch.zeros(3, device="jax")
    x.data = torch.arange(4.0, device="jax")
    assert x.shape == (4,) and x.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_module_dtype_conversion_on_jax():
    m = torch.nn.Linear(3, 2)
    ref = m.weight.detach().double()
    m.to("jax").double()
    assert m.weight.dtype == torch.float64 and isinstance(m.weight, t2j.Tensor)
    torch.testing.assert_close(m.weight.cpu(), ref)


def test_deepcopy_keeps_parameters():
    import copy

    m = torch.nn.Linear(3, 2).to("jax")
    m2 = copy.deepcopy(m)
    assert isinstance(m2.weight, torch.nn.Parameter) and m2.weight.requires_grad
    torch.testing.assert_close(m2.weight.cpu(), m.weight.cpu())
    m2.weight.data.zero_()
    assert m.weight.abs().sum().item() > 0


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_deepcopy_of_a_parameter_leaves_its_grad_a_tensors_keeps_it(device):
    import copy

    m = torch.nn.Linear(2, 1).to(device)
    t = torch.ones(2, device=device, requires_grad=True)
    (m(t[None]).sum() + t.sum()).backward()
    ema, t2 = copy.deepcopy(m), copy.deepcopy(t)
    assert ema.weight.grad is None and ema.bias.grad is None
    assert t2.grad.tolist() == t.grad.tolist() and t2.grad is not t.grad


def test_module_to_jax_keeps_shared_weights_and_optimizer_references():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.to("jax")
    assert m.head.weight is m.emb.weight and m.emb.weight.device.type == "jax"
    assert opt.param_groups[0]["params"][0] is m.emb.weight
    assert isinstance(m.emb.weight, torch.nn.Parameter)
    m.cpu()
    assert m.head.weight is m.emb.weight and m.emb.weight.device.type == "cpu"
    assert not torch.__future__.get_swap_module_params_on_conversion()


def test_module_moves_while_an_earlier_cpu_output_holds_its_parameters():
    # the output's autograd graph references the parameters, which swap_tensors then refuses:
    # they become new Parameters, as in torch, tied weights staying tied
    emb = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    net = torch.nn.Sequential(emb, torch.nn.LayerNorm(4), torch.nn.BatchNorm1d(4), head).eval()
    ids = torch.tensor([1, 2])
    out = net(ids)
    net.to("jax")
    assert net[3].weight is net[0].weight
    assert all(t.device.type == "jax" for t in (*net.parameters(), *net.buffers()))
    torch.testing.assert_close(net(ids.to("jax")).cpu(), out.detach())


def test_old_style_weight_norm_module_moves_between_devices_and_trains_like_torch():
    """nn.utils.weight_norm keeps the computed weight as a plain attribute whose graph
    references weight_g and weight_v: moving the module must still swap them."""
    torch.manual_seed(0)
    cpu = torch.nn.utils.weight_norm(torch.nn.Linear(3, 4))
    torch.manual_seed(0)
    jx = torch.nn.utils.weight_norm(torch.nn.Linear(3, 4)).to("jax")
    x = torch.randn(2, 3)
    for m, inp in ((cpu, x), (jx, x.to("jax"))):
        m(inp).square().sum().backward()
    assert jx.weight_g.device.type == "jax" and isinstance(jx.weight_g, torch.nn.Parameter)
    torch.testing.assert_close(jx.weight_g.grad.cpu(), cpu.weight_g.grad)
    torch.testing.assert_close(jx.weight_v.grad.cpu(), cpu.weight_v.grad)
    jx.cpu()
    assert jx.weight_v.device.type == "cpu"
    torch.testing.assert_close(jx(x), cpu(x))


def test_pin_memory_and_dataloader_pinning():
    """Registering the jax device makes torch see an accelerator, so DataLoader(pin_memory=True)
    pins every batch (in its pin-memory thread): that must work (a copy)."""
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.arange(4.0)
    pinned = x.pin_memory()
    assert torch.equal(pinned, x) and pinned.data_ptr() != x.data_ptr()
    data = TensorDataset(torch.arange(6.0), torch.arange(6))
    batches = list(DataLoader(data, batch_size=4, pin_memory=True))
    assert [b[0].tolist() for b in batches] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
    assert batches[1][1].dtype == torch.int64


def test_dataloader_workers_with_jax_tensors():
    """Forked workers cannot use JAX (a segfault before): a clear error naming the fix.
    Spawned workers get the dataset by value and send batches back by value."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(8.0, device="jax"), torch.arange(8, device="jax"))
    with pytest.raises(t2j.tensor.ForkedProcessError, match="multiprocessing_context='spawn'"):
        list(DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="fork"))
    batches = list(DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="spawn"))
    assert [b[0].device.type for b in batches] == ["jax", "jax"]
    assert batches[1][0].tolist() == [4.0, 5.0, 6.0, 7.0] and batches[1][1].dtype == torch.int64


def test_multiprocessing_queue_sends_jax_tensors_by_value():
    import multiprocessing.reduction

    x = torch.arange(6.0, device="jax").reshape(2, 3).bfloat16().requires_grad_()
    y = multiprocessing.reduction.ForkingPickler.loads(multiprocessing.reduction.ForkingPickler.dumps(x))
    assert isinstance(y, t2j.Tensor) and y.dtype == torch.bfloat16 and y.requires_grad
    assert torch.equal(y.cpu(), x.detach().cpu())


def test_storage_on_the_jax_device_is_refused():
    with pytest.raises(RuntimeError, match="cannot be allocated on the jax device"):
        torch.UntypedStorage(10, device="jax")
    assert torch.UntypedStorage(3).nbytes() == 3


def test_accelerator_apis_answer_for_the_jax_device():
    """Device-agnostic code times with torch.accelerator.synchronize() and logs memory."""
    assert torch.accelerator.current_accelerator().type == "jax"
    x = torch.randn(256, 256, device="jax")
    y = x @ x
    torch.accelerator.synchronize()
    torch.jax.synchronize()
    assert torch.accelerator.memory_allocated() >= y.numel() * 4
    assert torch.accelerator.max_memory_allocated() >= y.numel() * 4
    assert isinstance(torch.accelerator.memory_stats(), dict)
    torch.accelerator.empty_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.bool])
def test_dlpack_exports_the_value_of_a_jax_tensor(dtype):
    cpu = torch.arange(12).reshape(3, 4).to(dtype)
    view = cpu.to("jax")[:, 1::2]
    expected = cpu[:, 1::2]
    for exported in (torch.from_dlpack(view), torch.from_dlpack(torch.to_dlpack(view))):
        assert exported.device.type == "cpu" and exported.dtype == dtype
        torch.testing.assert_close(exported, expected, rtol=0, atol=0)
    if dtype != torch.bfloat16:  # numpy has no bfloat16
        np.testing.assert_array_equal(np.from_dlpack(view), expected.numpy())
    assert view.__dlpack_device__() == view.jax().__dlpack_device__()
    moved = torch.from_dlpack(view, device="jax")
    assert moved.device.type == "jax"
    torch.testing.assert_close(moved.cpu(), expected, rtol=0, atol=0)


def test_dlpack_refuses_like_torch():
    x = torch.ones(2, device="jax", requires_grad=True)
    with pytest.raises(BufferError, match="require gradient"):
        torch.from_dlpack(x)

    def export(y):
        return torch.from_dlpack(y * 2)

    with pytest.raises(BufferError, match="traced inside jit"):
        t2j.jit(export, fullgraph=True)(torch.ones(2, device="jax"))
    with pytest.warns(UserWarning, match="runs eagerly, op by op"):  # a graph break, as under torch.compile
        assert t2j.jit(export)(torch.ones(2, device="jax")).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_storage_level_writes_reach_every_view(device):
    results = []
    a = torch.zeros(4, device=device)
    view = a[1:]
    a.untyped_storage().copy_(torch.arange(1.0, 5.0, device=device).untyped_storage())
    results.append(view.tolist())
    a.untyped_storage().copy_(torch.arange(5.0, 9.0).untyped_storage())
    results.append(a.tolist())
    a.untyped_storage().fill_(1)
    results.append(a.tolist())
    ints = torch.zeros(2, dtype=torch.int32, device=device)
    ints.untyped_storage().copy_(torch.tensor([1.5, 2.0]).untyped_storage())
    results.append(ints.tolist())
    assert results == [[2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [2.3694278276172396e-38] * 4, [1069547520, 1073741824]]
    assert len(a.untyped_storage()) == a.untyped_storage().size() == 16
    with pytest.raises(RuntimeError, match="size does not match, self was 16 bytes but src was 12 bytes"):
        a.untyped_storage().copy_(torch.zeros(3).untyped_storage())


def test_a_jax_tensor_does_not_follow_later_writes_to_the_cpu_memory_it_was_copied_from():
    # JAX's CPU client took (or copied after returning) the NumPy view of the CPU tensor's memory
    src = torch.ones(1000)
    a = torch.zeros(1000, device="jax")
    a.untyped_storage().copy_(src.untyped_storage())
    b = src.to("jax")
    src.add_(1)
    assert a.eq(1).all() and b.eq(1).all()


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_torch_tensor_of_a_list_of_jax_scalars_reads_their_values(device):
    losses = [torch.tensor(1.5, device=device), torch.tensor(2.5, device=device)]
    counts = [torch.tensor(3, device=device), torch.tensor(4, device=device)]
    half = torch.tensor(2, dtype=torch.bfloat16, device=device)
    for built, values, dtype, on in [
        (torch.tensor(losses), [1.5, 2.5], torch.float32, "cpu"),
        (torch.tensor(counts), [3, 4], torch.int64, "cpu"),
        (torch.tensor([1.0, losses[0]]), [1.0, 1.5], torch.float32, "cpu"),
        (torch.as_tensor(losses), [1.5, 2.5], torch.float32, "cpu"),
        (torch.tensor([half, half]), [2.0, 2.0], torch.bfloat16, "cpu"),
        (torch.tensor(losses, device="jax"), [1.5, 2.5], torch.float32, "jax"),
    ]:
        assert (built.tolist(), built.dtype, built.device.type) == (values, dtype, on)
    with pytest.raises(ValueError, match="only one element tensors"):
        torch.tensor([torch.ones(2, device=device)])


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_views_under_inference_mode_are_normal_tensors(device):
    x = torch.arange(6.0, device=device)
    w = torch.nn.Parameter(torch.ones(3, 2, device=device))
    with torch.inference_mode():
        v = x.view(2, 3)
        y = v @ w.t().t()
        views = (x[1:], x.detach(), x.unsqueeze(0), x.expand(2, 6))
        x[:2].add_(1)
        flags = [v.is_inference(), y.is_inference(), y.view(-1).is_inference()] + [t.is_inference() for t in views]
    assert flags == [False, True, True, False, False, False, False]
    assert x.tolist() == [1.0, 2.0, 2.0, 3.0, 4.0, 5.0] and x._version == 1
    assert y.tolist() == [[3.0, 3.0], [12.0, 12.0]]


def test_python_numbers_of_tensors_under_inference_mode():
    # aten.item reaches the device undecomposed there: it went to the host fallback (prims.item), with a warning
    x = torch.tensor([1.5, -2.0], device="jax")
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error")
        y = x * 2
        got = (y.sum().item(), bool(y[0] > 0), float(y[1]), int(y[0]), y.tolist())
        with pytest.raises(RuntimeError, match="a Tensor with 2 elements cannot be converted to Scalar"):
            y.item()
    assert got == (-1.0, True, -4.0, 3, [3.0, -4.0])


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_copy_copy_shares_the_storage_as_torch(device):
    import copy

    x = torch.arange(3.0, device=device)
    shallow, tail = copy.copy(x), copy.copy(x[1:])
    shallow[0] = 100.0
    tail[0] = 7.0
    p = torch.nn.Parameter(torch.ones(2, device=device))
    q = copy.copy(p)
    q.data.mul_(3)
    assert x.tolist() == [100.0, 7.0, 2.0] and tail.shape == (2,) and shallow.is_leaf
    assert isinstance(q, torch.nn.Parameter) and q.requires_grad and p.tolist() == [3.0, 3.0]


def _through(how, t):
    import copy

    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(t, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    return {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": lambda x: pickle.loads(pickle.dumps(x))}[how](t)


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
def test_python_attributes_of_tensors_and_parameters_as_torch(how):
    # e.g. p.no_weight_decay = True read by an optimizer factory after deepcopying the model;
    # torch's Parameter.__deepcopy__ alone drops them
    def attributes(device):
        t, p = torch.ones(2, device=device), torch.nn.Parameter(torch.ones(2, device=device))
        t.tag, p.tp = [5], "col"
        t2, p2 = _through(how, t), _through(how, p)
        return getattr(t2, "tag", None), getattr(p2, "tp", None), isinstance(p2, torch.nn.Parameter), p2.device.type

    expected = attributes("cpu")
    assert attributes("jax") == expected[:3] + ("jax",)


def test_deepcopy_of_a_non_leaf_raises_like_torch():
    import copy

    messages = []
    for device in ("cpu", "jax"):
        x = torch.ones(2, device=device, requires_grad=True) * 2
        with pytest.raises(RuntimeError, match="graph leaves") as caught:
            copy.deepcopy(x)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_untyped_storage_reads_as_torch():
    import copy

    def reads(device):
        x = torch.arange(3.0, device=device)
        s = x.untyped_storage()
        buf = io.BytesIO()
        torch.save(x.storage(), buf)
        buf.seek(0)
        return (s.cpu().tolist(), s.tolist(), s[6], s[2:6].tolist(), s.clone().nbytes(), copy.deepcopy(s).tolist(),
                x.storage().cpu().tolist(), torch.load(buf).tolist())

    assert reads("jax") == reads("cpu")
    x = torch.arange(3.0, device="jax")
    c = x.untyped_storage().clone()
    x.add_(1)  # the clone has values of its own
    assert c.tolist() == torch.arange(3.0).untyped_storage().tolist() and c.device.type == "jax"


def test_storage_methods_as_torch():
    import copy

    def methods(device):
        x = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
        s, typed = x.untyped_storage(), x.storage()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (TypedStorage is deprecated)
            out = [typed.clone().tolist(), copy.deepcopy(typed).tolist(), pickle.loads(pickle.dumps(typed)).tolist(),
                   typed.int().tolist(), typed.double().tolist(), s.is_pinned(), typed.is_pinned(),
                   s.float().tolist()[:5], s.long().dtype, s.new().nbytes(), s.type(),
                   s is x[1:].untyped_storage(), s == x.untyped_storage()]
            typed.copy_(torch.tensor([4, 5, 6], dtype=torch.int32, device=device).storage())
        out.append(x.tolist())
        x.untyped_storage().byteswap(torch.int32)  # (was a silent no-op)
        z = torch.tensor([1 + 2j], dtype=torch.complex64, device=device)
        z.untyped_storage().byteswap(torch.complex64)
        return out + [x.tolist(), z.view(torch.int32).tolist()]

    assert methods("jax") == methods("cpu")


def test_jagged_nested_tensors_of_jax_tensors_as_on_the_cpu():
    # a jagged nested tensor holds its values as a jax tensor; its own __torch_dispatch__ runs the ops
    # where it meets a jax tensor (torch2jax's returns NotImplemented for a foreign subclass)
    torch.manual_seed(0)
    a, b, w = torch.randn(3, 4), torch.randn(2, 4), torch.randn(5, 4)

    def run(device):
        x, y, weight = (t.to(device).requires_grad_() for t in (a, b, w))
        nt = torch.nested.nested_tensor([x, y], layout=torch.jagged)
        out = torch.nested.to_padded_tensor(torch.nn.functional.linear(nt, weight).relu().softmax(-1), 0.0)
        (out.sum() + torch.nested.as_nested_tensor([x, y], layout=torch.jagged).sin().values().sum()).backward()
        rows = torch.arange(10.0, device=device).reshape(2, 5)
        narrow = torch.nested.narrow(rows, 1, torch.tensor([0, 1], device=device),
                                     torch.tensor([3, 2], device=device), layout=torch.jagged)
        moved = torch.nested.nested_tensor([a, b], layout=torch.jagged).to(device) * 2
        return [t.detach().cpu() for t in (out, weight.grad, x.grad, y.grad, *narrow.unbind(), *moved.unbind())]

    got, want = run("jax"), run("cpu")
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(got, want)), (got, want)


def test_deterministic_mode_fills_uninitialized_memory_as_torch():
    def filled(device):
        x = torch.ones(2, device=device)
        made = [torch.empty(2, dtype=dt, device=device) for dt in (torch.float16, torch.complex64, torch.int32,
                                                                    torch.uint8, torch.bool)]
        made += [torch.empty_like(x), x.new_empty(2), torch.empty_strided((2,), (1,), device=device),
                 torch.zeros(2, device=device).resize_(4)]
        return str([t.cpu().tolist() for t in made])

    filled("jax")  # ops compiled outside deterministic mode must not keep its zeros
    torch.use_deterministic_algorithms(True)
    try:
        assert filled("jax") == filled("cpu")
        torch.utils.deterministic.fill_uninitialized_memory = False
        assert torch.empty(2, device="jax").tolist() == [0.0, 0.0]
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = True
        torch.use_deterministic_algorithms(False)
    assert torch.empty(2, device="jax").tolist() == [0.0, 0.0]


def test_data_ptr_of_an_empty_storage_is_null_as_torch():
    for device in ("cpu", "jax"):
        x = torch.empty(0, device=device)
        assert x.data_ptr() == 0 and x.untyped_storage().data_ptr() == 0
        y = torch.ones(3, device=device)
        assert y[3:].data_ptr() == y[:0].data_ptr() == 0 and y[:0].untyped_storage().data_ptr() == y.data_ptr() != 0


def test_moving_a_cpu_tensor_leaves_it_resizable():
    buf = torch.zeros(2)
    moved = buf.to("jax")
    buf.add_(1)  # the copy is independent
    buf.resize_(8)
    torch.cat([torch.ones(3), torch.ones(3)], out=buf.resize_(0))
    assert moved.tolist() == [0.0, 0.0] and buf.shape == (6,)


def test_pin_memory_of_jax_tensors_needs_no_host_fallback():
    x = torch.randn(4, 2, device="jax")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the host fallback warns)
        pinned = x.pin_memory()
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2, pin_memory=True)
        batches = [b[0] for b in loader]
    assert not x.is_pinned() and pinned.device.type == "jax" and torch.equal(pinned.cpu(), x.cpu())
    pinned.add_(1)  # a tensor of its own, as torch's copy into pinned memory
    assert not torch.equal(pinned.cpu(), x.cpu())
    assert torch.equal(torch.cat(batches).cpu(), x.cpu())


@pytest.mark.parametrize("shape", [(6,), (3, 4), (2, 3, 4), (4, 1, 3), (2, 2, 2, 2)])
def test_storage_box_of_a_contiguous_range(shape):
    """`tensor._box`: where the row-major elements [offset, offset + n) of an array are one box, the
    box (starts, shape) holds exactly those elements; where it says None, no box does."""
    import itertools

    import numpy as np

    from torch2jax.tensor import _box

    flat = np.arange(int(np.prod(shape)))
    array = flat.reshape(shape)
    for offset, n in itertools.product(range(flat.size), range(1, flat.size + 1)):
        if offset + n > flat.size:
            continue
        box = _box(shape, offset, n)
        if box is None:
            # a box is a range in one dimension, full after it, single indices before it
            boxes = [(d, k) for d in range(len(shape)) for k in range(1, shape[d] + 1)
                     if n == k * int(np.prod(shape[d + 1:])) and offset % int(np.prod(shape[d + 1:])) == 0
                     and offset // int(np.prod(shape[d + 1:])) % shape[d] + k <= shape[d]]
            assert not boxes, (offset, n, boxes)
            continue
        starts, block = box
        got = array[tuple(slice(s, s + b) for s, b in zip(starts, block))].reshape(-1)
        np.testing.assert_array_equal(got, flat[offset:offset + n])


def test_to_jax_keeps_the_strides_of_size_one_dimensions():
    """torch's channels_last gives a size-1 channel dimension the stride H*W*C (it addresses
    nothing); the copy on the jax device keeps it."""
    w = torch.randn(8, 1, 3, 3).to(memory_format=torch.channels_last)
    assert w.to("jax").stride() == w.stride() == (9, 1, 3, 1)
    assert torch.equal(w.to("jax").cpu(), w)


def test_results_keep_the_strides_of_size_one_dimensions():
    w = torch.randn(8, 1, 3, 3).to(memory_format=torch.channels_last)
    x = w.to("jax")
    assert x.stride() == w.stride() == (9, 1, 3, 1)
    # torch's CPU kernels: contiguous for a pointwise op on tensors of one shape (TensorIterator's fast
    # path), the input's strides for one with a number or a broadcast operand, and for clone / *_like
    b = torch.randn(3, 3)
    ops = (torch.relu, torch.sigmoid, lambda t: t * t, lambda t: torch.addcmul(t, t, t), lambda t: t.clamp(0),
           lambda t: t ** 2, lambda t: t + 1, lambda t: t * 2, lambda t: t + b.to(t.device), torch.clone,
           torch.zeros_like, lambda t: t.double(), lambda t: torch.where(t > 0, t, 0.0), lambda t: t.softmax(-1))
    for op in ops:
        assert op(x).stride() == op(w).stride()
    assert (x[:, :, :1] + 1).stride() == (w[:, :, :1] + 1).stride()


def _outcome(fn, device):
    """What ``fn(device)`` gives: its value as plain Python data, or its error's type and message."""
    try:
        out = fn(device)
    except Exception as e:  # noqa: BLE001 - the error is the outcome compared
        return type(e).__name__, str(e).split("\n")[0]
    if isinstance(out, torch.Tensor):
        return out.dtype, tuple(out.shape), out.cpu().tolist()
    return out


class _Tagged(torch.Tensor):
    pass


def _repr_of(fn):
    def run(device):
        with torch.no_grad():
            text = repr(fn(device))
        return text.replace("device='jax:0', ", "").replace(", device='jax:0'", "").replace("device='jax:0'", "")
    return run


# each runs on the CPU and on the jax device and must give the same outcome
_SURFACE = {
    "linspace_complex_ends": lambda d: torch.linspace(1 + 1j, 2 + 2j, 3, device=d),
    "logspace_complex_end": lambda d: torch.logspace(0, 1j, 2, device=d),
    "linspace_complex_tensor_end": lambda d: torch.linspace(torch.tensor(1 + 1j, device=d), 2.0, 2),
    "complex_to_bool": lambda d: torch.tensor([0j, 1j, 2 + 0j], device=d).bool(),
    "complex_copy_into_bool": lambda d: torch.zeros(2, dtype=torch.bool, device=d).copy_(
        torch.tensor([0j, 1j], device=d)),
    "float8_e4m3fn_saturates": lambda d: torch.tensor([500.0, 1e4, float("inf"), -1e4, 3.3], device=d).to(
        torch.float8_e4m3fn).float(),
    "bfloat16_to_float8_e4m3fn": lambda d: torch.tensor([-500.0, 448.0], dtype=torch.bfloat16, device=d).to(
        torch.float8_e4m3fn).float(),
    "channels_last_needs_rank_4": lambda d: torch.ones(2, 3, 4, device=d).contiguous(
        memory_format=torch.channels_last),
    "channels_last_3d_needs_rank_5": lambda d: torch.ones(2, 3, 4, 5, device=d).to(
        memory_format=torch.channels_last_3d),
    "empty_channels_last_needs_rank_4": lambda d: torch.empty(2, 3, 4, device=d, memory_format=torch.channels_last),
    "channels_last_rank_4": lambda d: torch.ones(2, 3, 4, 5, device=d).contiguous(
        memory_format=torch.channels_last).stride(),
    "fill_needs_a_0d_value": lambda d: torch.zeros(2, device=d).fill_(torch.tensor([5.0], device=d)),
    "fill_with_0d_value": lambda d: torch.zeros(2, device=d).fill_(torch.tensor(5.0, device=d)),
    "untyped_storage_setitem": lambda d: _storage_bytes_written(torch.zeros(2, device=d)),
    "as_subclass": lambda d: _subclass_outcome(torch.ones(2, device=d, requires_grad=True)),
    "repr_suffix_order": _repr_of(lambda d: torch.ones(2, dtype=torch.int32, device=d)),
    "repr_of_a_subclass": _repr_of(lambda d: torch.nn.Parameter(torch.ones(2, device=d).as_subclass(_Tagged))),
}


def _storage_bytes_written(x):
    s = x.untyped_storage()
    s[0] = 5
    s[4:6] = 7
    return x.untyped_storage().tolist()


def _subclass_outcome(x):
    y = x.as_subclass(_Tagged)
    z = y * 3
    z.sum().backward()
    p = torch.nn.Parameter(x.detach().as_subclass(_Tagged))
    return [isinstance(y, _Tagged), isinstance(z, _Tagged), y.device.type == x.device.type, x.grad.tolist(),
            isinstance(p, torch.nn.Parameter) and isinstance(p, _Tagged), type(y.as_subclass(torch.Tensor)) is type(x)]


class _WithNewEmpty(torch.Tensor):
    def new_empty(self, *args, **kwargs):
        return super().new_empty(*args, **kwargs).as_subclass(_WithNewEmpty)


def _subclass_to_cpu(x):
    # x.as_subclass(MyT).cpu() is a working CPU MyT, as on CUDA (the jax-side class over a CPU tensor was not)
    y = x.as_subclass(_Tagged)
    outs = [y.cpu(), y.to("cpu"), y.to("cpu", torch.float64)]
    return [(type(c) is _Tagged, c.device.type, repr(c), c.tolist(), c.numpy().tolist(), repr(c + 1), type(c * 2))
            for c in outs]


def _subclass_through(how):
    def run(device):
        y = torch.arange(3.0, device=device).as_subclass(_Tagged)
        y.tag = 5
        z = _through(how, y)
        # (on the jax device the type is a subclass of _Tagged and torch2jax.Tensor: `on_jax_device`)
        return (isinstance(z, _Tagged), type(z).__name__, z.tag, z.tolist(), z.device.type == device,
                type(z + 1) is type(y))
    return run


def _deepcopy_of_subclasses(device):
    import copy

    z = copy.deepcopy(torch.arange(3.0, device=device).as_subclass(_WithNewEmpty))
    out = [type(z).__name__, z.tolist(), z.device.type == device]
    try:  # torch refuses a subclass whose new_empty gives a plain tensor
        copy.deepcopy(torch.arange(3.0, device=device).as_subclass(_Tagged))
    except RuntimeError as e:
        out.append(str(e))
    return out


_SURFACE.update({
    "subclass_to_cpu": lambda d: _subclass_to_cpu(torch.arange(3.0, device=d)),
    "subclass_pickle": _subclass_through("pickle"),
    "subclass_torch_save": _subclass_through("torch.save"),
    "subclass_copy": _subclass_through("copy"),
    "subclass_deepcopy": _deepcopy_of_subclasses,
})


@pytest.mark.parametrize("name", sorted(_SURFACE))
def test_tensor_surface_matches_cpu(name):
    fn = _SURFACE[name]
    assert _outcome(fn, "jax") == _outcome(fn, "cpu")


def test_repr_wraps_suffixes_at_the_line_width():
    x = torch.arange(12.0, device="jax").requires_grad_() * 1
    with torch.no_grad():
        torch.set_printoptions(linewidth=40)
        try:
            text = repr(x)
        finally:
            torch.set_printoptions(profile="default")
    assert text.splitlines()[-2:] == ["       device='jax:0',", "       grad_fn=<MulBackward0>)"]


def test_a_device_index_past_the_one_jax_device_is_refused():
    for make in (lambda: torch.zeros(2).to("jax:1"), lambda: torch.ones(1, device="jax:2"),
                 lambda: torch.zeros(2, device="jax").new_ones(2, device="jax:1")):
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            make()
    assert torch.zeros(2, device="jax:0").to("jax:0").device == torch.device("jax", 0)


def test_jit_keeps_torch_size_arguments_and_outputs():
    x = torch.ones(3, 4, device="jax")
    f = t2j.jit(lambda x, s: (x.reshape(s) * s.numel(), s, x.shape))
    for _ in range(2):
        y, s, shape = f(x, torch.Size([12]))
        assert type(s) is torch.Size and type(shape) is torch.Size and shape == (3, 4)
        assert y.tolist() == [12.0] * 12
    assert f.stats["traces"] == 1


def test_numpy_of_a_jax_tensor_is_a_read_only_copy():
    # on the CPU the array shares the tensor's memory; here it is a copy, so a write to it would be
    # lost: refused instead
    x = torch.arange(3.0, device="jax")
    for array in (x.numpy(), x.numpy(force=True), np.asarray(x)):
        assert array.tolist() == [0.0, 1.0, 2.0]
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 5
    copy = x.numpy().copy()
    copy[0] = 5
    assert copy.tolist() == [5.0, 1.0, 2.0] and x.tolist() == [0.0, 1.0, 2.0]
