"""Sparse tensors on the jax device (torch2jax/ops/sparse.py): torch's sparse layouts holding jax
tensors, against torch CPU (parts, flags, values, gradients, optimizers, save/load), and the dense
stand-in a traced program makes."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

import torch2jax as t2j


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(stored dense|Sparse invariant)")
        yield


def _same_sparse(got, expected):
    """``got`` (jax) is the sparse tensor ``expected`` (CPU): layout, dtype, size, parts and flags."""
    assert got.device.type == "jax" and got.layout == expected.layout and got.dtype == expected.dtype
    assert got.shape == expected.shape
    if expected.layout == torch.sparse_coo:
        assert got.is_coalesced() == expected.is_coalesced()
        assert (got.sparse_dim(), got.dense_dim()) == (expected.sparse_dim(), expected.dense_dim())
        if expected.is_coalesced():  # (an uncoalesced tensor's number and order of elements are the kernel's own)
            assert got._nnz() == expected._nnz()
            assert torch.equal(got._indices().cpu(), expected._indices())
            torch.testing.assert_close(got._values().cpu(), expected._values())
    torch.testing.assert_close(got.to_dense().cpu(), expected.to_dense())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.complex64, torch.bool])
def test_sparse_coo_tensor_keeps_its_parts(dtype):
    indices = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])  # (0, 2) twice: summed by coalesce
    values = torch.arange(1, 5).to(dtype)
    expected = torch.sparse_coo_tensor(indices, values, (2, 3))
    got = torch.sparse_coo_tensor(indices.to("jax"), values.to("jax"), (2, 3))
    assert torch.equal(got._indices().cpu(), indices) and torch.equal(got._values().cpu(), values)
    _same_sparse(got, expected)
    _same_sparse(got.coalesce(), expected.coalesce())
    assert got.coalesce().indices().device.type == "jax"
    _same_sparse(got.cpu().to("jax"), expected)
    assert got.cpu().layout == torch.sparse_coo and got.cpu().device.type == "cpu"


def test_hybrid_sparse_tensor_with_dense_dimensions():
    indices = torch.tensor([[0, 2, 0]])
    values = torch.randn(3, 4)
    expected = torch.sparse_coo_tensor(indices, values, (3, 4))
    got = torch.sparse_coo_tensor(indices.to("jax"), values.to("jax"), (3, 4))
    _same_sparse(got, expected)
    _same_sparse(got.coalesce(), expected.coalesce())
    _same_sparse(got.to_dense().to_sparse(1), expected.to_dense().to_sparse(1))


def _pair():
    indices, values = torch.tensor([[0, 1, 2, 2, 0], [1, 2, 0, 2, 1]]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    return (torch.sparse_coo_tensor(indices, values, (3, 3)),
            torch.sparse_coo_tensor(indices.to("jax"), values.to("jax"), (3, 3)))


@pytest.mark.parametrize("op", [
    lambda a, d: a + a, lambda a, d: a.coalesce() - 2 * a.coalesce(), lambda a, d: a * 3, lambda a, d: a / 2,
    lambda a, d: -a, lambda a, d: a * d, lambda a, d: d + a, lambda a, d: a.sum(), lambda a, d: d.sparse_mask(a),
    lambda a, d: a @ d, lambda a, d: torch.sparse.addmm(d, a, d, beta=0.5, alpha=2.0), lambda a, d: a.t(),
    lambda a, d: torch.sparse.sum(a, 1), lambda a, d: torch.sparse.softmax(a, 1), lambda a, d: a.clone().mul_(2),
    lambda a, d: d.clone().add_(a, alpha=-2), lambda a, d: d.to_sparse(), lambda a, d: d.to_sparse_csr(),
    lambda a, d: d.to_sparse_csr().to_dense(), lambda a, d: a.to(torch.float64), lambda a, d: a.to_dense(),
])
def test_sparse_ops_match_torch(op):
    a, aj = _pair()
    d = torch.arange(9.0).reshape(3, 3) - 4
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*runs on the host")
        expected, got = op(a, d), op(aj, d.to("jax"))
    if expected.layout == torch.strided:
        assert got.layout == torch.strided and got.dtype == expected.dtype
        torch.testing.assert_close(got.cpu(), expected)
    else:
        _same_sparse(got, expected)


@pytest.mark.parametrize("dims", [(0,), (3,), (0, 1), (1, 3), (0, 1, 2), (0, 1, 2, 3)])
@pytest.mark.parametrize("coalesced", [True, False])
def test_sparse_sum_over_dims_and_its_gradient_match_torch(dims, coalesced, monkeypatch):
    """Summed over sparse and dense dimensions, on the device (no host copy), gradient included."""
    monkeypatch.setattr(t2j.ops.sparse, "_warned_host", set())  # (a host kernel warns once per process)
    indices = torch.tensor([[0, 1, 1, 2, 0], [2, 0, 2, 1, 2], [0, 0, 1, 1, 0]])  # (0, 2, 0) twice
    base = torch.sparse_coo_tensor(indices, torch.randn(5, 2), (3, 3, 2, 2))
    base = base.coalesce() if coalesced else base
    results, grads = [], []
    for device in ("cpu", "jax"):
        x = base.to(device).detach().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no host kernel)
            out = torch.sparse.sum(x, dims)
            dense = out.to_dense() if out.is_sparse else out
            (dense * torch.arange(1.0, 1 + dense.numel(), device=device).view(dense.shape)).sum().backward()
        results.append(out)
        grads.append(x.grad.coalesce())
    if results[0].is_sparse:
        _same_sparse(results[1], results[0])
    else:
        torch.testing.assert_close(results[1].cpu(), results[0])
    assert torch.equal(grads[1]._indices().cpu(), grads[0]._indices())
    torch.testing.assert_close(grads[1]._values().cpu(), grads[0]._values())


def test_sparse_gradients_match_torch():
    indices, values, w = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]]), torch.randn(4), torch.randn(3, 2)
    grads = []
    for device in ("cpu", "jax"):
        v, m = values.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
        a = torch.sparse_coo_tensor(indices.to(device), v, (2, 3))
        weights = torch.arange(6.0, device=device).reshape(2, 3)
        ((a.to_dense() * weights).sum() + torch.sparse.mm(a, m).pow(2).sum()).backward()
        grads.append((v.grad.cpu(), m.grad.cpu()))
    torch.testing.assert_close(grads[1], grads[0])


def test_sparse_embedding_gradient_is_sparse_and_optimizers_take_it():
    torch.manual_seed(0)
    ref = nn.Embedding(12, 4, sparse=True, padding_idx=0)
    model = copy.deepcopy(ref).to("jax")
    idx = torch.tensor([[1, 2, 1], [4, 1, 0]])
    for opt_class in (torch.optim.SGD, torch.optim.SparseAdam):
        opts = [opt_class(m.parameters(), lr=0.1) for m in (ref, model)]
        for _ in range(2):
            for m, opt, ids in ((ref, opts[0], idx), (model, opts[1], idx.to("jax"))):
                opt.zero_grad()
                m(ids).pow(3).sum().backward()
                opt.step()
            _same_sparse(model.weight.grad, ref.weight.grad)
            torch.testing.assert_close(model.weight.detach().cpu(), ref.weight.detach())
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
        torch.optim.Adam(model.parameters()).step()


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_sparse_embedding_bag_gradient_is_sparse(mode):
    torch.manual_seed(0)
    ref = nn.EmbeddingBag(10, 3, mode=mode, sparse=True)
    model = copy.deepcopy(ref).to("jax")
    inputs, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 5])
    ref(inputs, offsets).pow(2).sum().backward()
    model(inputs.to("jax"), offsets.to("jax")).pow(2).sum().backward()
    _same_sparse(model.weight.grad, ref.weight.grad)


def test_sparse_tensors_save_and_load():
    a, aj = _pair()
    buffer = io.BytesIO()
    torch.save({"a": aj, "c": aj.coalesce()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    _same_sparse(loaded["a"], a)
    _same_sparse(loaded["c"], a.coalesce())
    assert "layout=torch.sparse_coo" in repr(aj) and "jax" in repr(aj)


def test_sparse_embedding_trains_like_torch_under_jit():
    torch.manual_seed(0)
    ref = nn.Embedding(12, 4, sparse=True)
    model = copy.deepcopy(ref).to("jax")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    idx = torch.tensor([[1, 2, 1], [4, 1, 0]])

    def step(m, opt, ids):
        opt.zero_grad()
        loss = m(ids).pow(2).sum()
        loss.backward()
        opt.step()
        return loss

    jitted = t2j.jit(step)
    ref_losses = [step(ref, opts[0], idx).item() for _ in range(3)]
    losses = [jitted(model, opts[1], idx.to("jax")).item() for _ in range(3)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    torch.testing.assert_close(model.weight.detach().cpu(), ref.weight.detach())


def test_traced_sparse_tensors_are_stored_dense_and_to_sparse_refuses():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        from torch2jax.ops import sparse

        sparse._warned_dense = False
        f = t2j.jit(lambda v: torch.sparse_coo_tensor(torch.tensor([[0, 0]], device="jax"), v, (2,)) * 2)
        for _ in range(2):
            got = f(torch.tensor([1.0, 2.0], device="jax"))
    assert sum("stored dense" in str(w.message) for w in record) == 1
    assert got.layout == torch.strided and got.cpu().tolist() == [6.0, 0.0]
    with pytest.raises(t2j.OpError, match="_to_sparse has an output shape that depends on tensor values"):
        t2j.jit(lambda x: x.to_sparse(), fullgraph=True)(torch.eye(2, device="jax"))


def test_torch_sparse_matmul_under_jit_with_a_sparse_constant():
    # a sparse tensor made outside, read by a jitted function: its parts are constants of the program,
    # and its kernels (torch.sparse.mm / addmm) are lowered, so JAX differentiates the program
    a, aj = _pair()
    w = torch.randn(3, 2)
    wc, wj = w.clone().requires_grad_(), w.to("jax").requires_grad_()
    bias = torch.ones(3, 2)
    expected = torch.sparse.addmm(bias, a, wc, beta=0.5, alpha=2.0) + torch.sparse.mm(a, wc)
    with t2j.env(fallback="error"):
        got = t2j.jit(lambda w: torch.sparse.addmm(bias.to("jax"), aj, w, beta=0.5, alpha=2.0)
                      + torch.sparse.mm(aj, w))(wj)
        torch.testing.assert_close(got.detach().cpu(), expected.detach())
        (expected * torch.arange(6.0).reshape(3, 2)).sum().backward()
        (got * torch.arange(6.0, device="jax").reshape(3, 2)).sum().backward()
        torch.testing.assert_close(wj.grad.cpu(), wc.grad)


def test_a_sparse_tensor_a_jitted_step_reads_is_carried_not_baked_in():
    # a GCN-style step reading a sparse adjacency it does not receive: its parts are state of the program (one trace),
    # so a later in-place change of its values is seen without a retrace
    torch.manual_seed(0)
    indices, values, lin0 = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 2]]), torch.tensor([0.1, 0.2, 0.3, 0.4]), nn.Linear(2, 2)
    runs = []
    for device, wrap in (("cpu", lambda f: f), ("jax", t2j.jit)):
        adj = torch.sparse_coo_tensor(indices.to(device), values.clone().to(device), (3, 3))
        lin = copy.deepcopy(lin0).to(device)
        opt = torch.optim.SGD(lin.parameters(), lr=0.05)

        def step(x):
            opt.zero_grad()
            loss = torch.sparse.mm(adj, lin(x)).pow(2).sum() + (adj * 2).to_dense().sum()
            loss.backward()
            opt.step()
            return loss

        step, x = wrap(step), torch.ones(3, 2, device=device)
        losses = [step(x).item() for _ in range(2)]
        adj._values().mul_(2)
        runs.append(losses + [step(x).item() for _ in range(2)])
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)
    assert step.stats["traces"] == 2  # (the first call's state, with no .grad yet, and every later one)


def test_host_kernels_of_sparse_ops_warn_once_and_refuse_when_traced():
    a, aj = _pair()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            got = torch.sparse.log_softmax(aj, 0)
    assert sum("aten._sparse_log_softmax.default on a sparse jax tensor runs on the host" in str(w.message)
               for w in record) == 1
    _same_sparse(got, torch.sparse.log_softmax(a, 0))
    with pytest.raises(t2j.OpError, match="_sparse_log_softmax.* a traced program .* cannot run it on the host"):
        t2j.jit(lambda x: torch.sparse.log_softmax(aj * x, 0), fullgraph=True)(torch.tensor(2.0, device="jax"))
