"""Sparse COO tensors on the jax device are stored dense (torch2jax/ops/sparse.py):
their values against torch CPU's ``to_dense()``, and nn.Embedding(sparse=True)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import torch2jax as t2j


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(no sparse layout|Sparse invariant)")
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.complex64])
def test_sparse_coo_tensor_is_its_dense_value(dtype):
    indices = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])  # (0, 2) twice: summed, as coalesce does
    values = torch.arange(1, 5).to(dtype)
    expected = torch.sparse_coo_tensor(indices, values, (2, 3)).to_dense()
    got = torch.sparse_coo_tensor(indices.to("jax"), values.to("jax"), (2, 3))
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.cpu(), expected)


def test_hybrid_sparse_tensor_with_dense_dimensions():
    indices = torch.tensor([[0, 2, 0]])
    values = torch.randn(3, 4)
    expected = torch.sparse_coo_tensor(indices, values, (3, 4)).to_dense()
    got = torch.sparse_coo_tensor(indices.to("jax"), values.to("jax"), (3, 4))
    torch.testing.assert_close(got.cpu(), expected)


def test_sparse_embedding_gradient_is_the_dense_gradient():
    torch.manual_seed(0)
    ref = nn.Embedding(12, 4, sparse=True, padding_idx=0)
    model = copy.deepcopy(ref).to("jax")
    idx = torch.tensor([[1, 2, 1], [4, 1, 0]])
    ref(idx).pow(3).sum().backward()
    model(idx.to("jax")).pow(3).sum().backward()
    torch.testing.assert_close(model.weight.grad.cpu(), ref.weight.grad.to_dense())


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


def test_dense_storage_warns_once():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        from torch2jax.ops import sparse

        sparse._warned = False
        for _ in range(2):
            torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (2,), device="jax")
    assert sum("no sparse layout" in str(w.message) for w in record) == 1


@pytest.mark.parametrize("convert", [lambda x: x.to_sparse(), lambda x: x.to_sparse(1), lambda x: x.to_sparse_csr(),
                                     lambda x: x.to_sparse_csc(), lambda x: x.to_sparse(layout=torch.sparse_bsr,
                                                                                         blocksize=(1, 1))])
def test_to_sparse_layouts_raise_a_clear_error(convert):
    x = torch.eye(3, device="jax")
    with pytest.raises(t2j.OpError, match="the jax device has no sparse layouts .* x.cpu\\(\\).to_sparse\\(\\)"):
        convert(x)
    assert convert(x.cpu()).layout != torch.strided  # what the message suggests works


def test_torch_sparse_matmul_and_sum_are_lowered():
    # torch.sparse.mm / addmm / sum(dim) on the dense stand-in: lowered (no host round trip),
    # so a jitted forward is differentiated by JAX when its backward runs outside it
    indices, values = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 2]]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    a = torch.sparse_coo_tensor(indices, values, (3, 3))
    aj = torch.sparse_coo_tensor(indices.to("jax"), values.to("jax"), (3, 3))
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
        for dim in ([0], [1], [0, 1]):
            torch.testing.assert_close(torch.sparse.sum(aj, dim).cpu(), torch.sparse.sum(a, dim).to_dense())


def test_sparse_layout_ops_name_the_dense_storage():
    """Ops torch has only sparse kernels for (``_nnz``, ``torch.sparse.softmax``) on a sparse tensor moved to the jax
    device, which is stored dense there: an error naming the op and why, not torch's about the CPU backend."""
    a = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2)).to("jax")
    for call in (lambda: a._nnz(), lambda: torch.sparse.softmax(a, 1)):
        with pytest.raises(t2j.OpError, match="sparse layout, which the jax device does not have"):
            call()
