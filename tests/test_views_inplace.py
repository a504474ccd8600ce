"""Views and in-place ops, differentially against torch CPU.

Each program mutates its inputs through views and returns some tensors; it runs
once on torch CPU tensors and once on jax-device copies of them, and every
returned tensor and every input must agree afterwards: a write to a view must
be seen by its base and by every other view of the same storage.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch2jax  # noqa: F401


def _inputs(specs, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in specs:
        if dtype.is_floating_point or dtype.is_complex:
            out.append(torch.randn(shape, generator=g, dtype=dtype))
        elif dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=g).bool())
        else:
            out.append(torch.randint(-5, 5, shape, generator=g, dtype=dtype))
    return out


def run_both(program, *specs):
    specs = [(s, torch.float32) if not isinstance(s[-1], torch.dtype) else s for s in specs]
    cpu = _inputs(specs)
    jx = [t.to("jax") for t in cpu]
    out_cpu = program(*cpu)
    out_jax = program(*jx)
    if not isinstance(out_cpu, tuple):
        out_cpu, out_jax = (out_cpu,), (out_jax,)
    for i, (a, e) in enumerate(zip(tuple(out_jax) + tuple(jx), tuple(out_cpu) + tuple(cpu))):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch2jax.Tensor), f"result {i} is {type(a)}"
            assert a.dtype == e.dtype and a.shape == e.shape, f"result {i}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
            torch.testing.assert_close(a.cpu(), e, msg=lambda m: f"result {i}: {m}")
        else:
            assert a == e


def p_select_add(x):
    x[:, 0].add_(1)
    return x


def p_view_setitem(x):
    x.view(-1)[3] = 5
    return x


def p_t_mul(x):
    y = x.t()
    y.mul_(2)
    return y


def p_chained(x):
    y = x[1:]
    z = y.t()
    z[0].fill_(9)
    return y, z


def p_stale_view(x):
    y = x[0]
    x.add_(1)
    return y


def p_two_views(x):
    a = x[:, 1]
    b = x.t()[1]
    a.mul_(3)
    return b


def p_narrow(x):
    x.narrow(1, 1, 2).zero_()
    return x


def p_diagonal(x):
    x.diagonal().fill_(-1)
    d = x.diagonal(offset=1)
    d.add_(10)
    return d


def p_unfold(x):
    u = x.unfold(1, 2, 2)
    u.mul_(0.5)
    return u


def p_expand_read(x):
    e = x[:1].expand(3, 4)
    x[0, 0] = 100.0
    return e.clone()


def p_as_strided(x):
    s = x.as_strided((2, 2), (1, 4), 1)
    s.fill_(7)
    return s


def p_detach_shares(x):
    d = x.detach()
    d.zero_()
    return d


def p_data_shares(x):
    x.data.add_(1)
    return x.data


def p_split_chunk_unbind(x):
    a, b = x.split(2, dim=1)
    b.fill_(1)
    c = x.chunk(2, dim=0)[1]
    c.mul_(2)
    r = x.unbind(0)[0]
    r.sub_(3)
    return a, c, r


def p_squeeze_unsqueeze(x):
    y = x.unsqueeze(0).squeeze(0)
    y[1].fill_(4)
    return y.unsqueeze(-1)


def p_bool_mask_setitem(x):
    x[x > 0] = 0
    return x


def p_index_tensor_setitem(x):
    x[torch.tensor([0, 2])] = torch.ones(4, device=x.device)
    return x


def p_index_put_accumulate(x):
    idx = (torch.tensor([0, 0, 1]),)
    x.index_put_(idx, torch.ones(3, 4, device=x.device), accumulate=True)
    return x


def p_setitem_on_view(x):
    v = x[1:, ::2]
    v[v < 0] = -1.0
    return v


def p_copy_across_dtypes(x, y):
    x[0].copy_(y[0])
    y[1].copy_(x[1])
    return x, y


def p_copy_broadcast(x):
    x[1:].copy_(torch.arange(4.0))
    return x


def p_out_arg(x, y):
    out = torch.empty_like(x)
    torch.add(x, y, out=out)
    return out


def p_out_into_view(x, y):
    torch.mul(x[0], y[0], out=x[1])
    return x


def p_dtype_view(x):
    v = x.view(torch.int32)
    v[0, 0] = 0
    return v


def p_view_as_real(x):
    r = torch.view_as_real(x)
    r[..., 1].zero_()
    return r


def p_inplace_unary_on_view(x):
    x[1].sigmoid_()
    x[:, 2].clamp_(min=0.0)
    x[2].masked_fill_(x[2] < 0.5, 3.0)
    return x


def p_transpose_reshape(x):
    y = x.transpose(0, 1).reshape(-1)  # reshape of a non-contiguous view copies, as in torch
    y.fill_(0)
    return y


def p_int_inplace(x):
    x[0].add_(2**40)
    x.floor_divide_(3)
    return x


def p_set_aliases_source(x, y):
    # x becomes another tensor on y's storage (shape and all): writes through either are seen by both
    x.set_(y)
    x[0].fill_(5)
    y[1, :2].mul_(-1)
    return x, x.shape == y.shape


def p_complex_dtype_views(z, x):
    # bit views between complex and real dtypes, written through
    z.view(torch.float32)[:, 1].mul_(-2)
    z.view(torch.int64)[0].zero_()
    w = x.view(torch.complex64)
    w[1].mul_(1j)
    return z, x, z.view(torch.float64), x.view(torch.complex128)


def p_conj_is_a_view(z):
    # x.conj() aliases x: a write through it lands conjugated
    c = z.conj()
    c[0].mul_(2)
    z.conj().t()[1, 0] = 5j
    return z, c, z.conj().resolve_conj()


def p_conj_and_neg_bits(z):
    # the conjugate (and, from z.conj().imag, negative) bits are torch's: is_conj(), what
    # views of such a view read, in place writes through them, and what torch refuses
    c = z.conj()
    imag = c.imag  # torch: a negative view of z's imaginary parts
    strided = c.as_strided((2,), (1,), 1)  # storage elements, conjugated
    flags = (c.is_conj(), c[1:].is_conj(), c.detach().is_conj(), c.conj().is_conj(), c.resolve_conj().is_conj(),
             (c * 2).is_conj(), imag.is_neg(), z.conj_physical().is_conj(), c.view(2, 2).mH.is_conj())
    refused = []
    for attempt in (lambda: torch.view_as_real(c), lambda: c.view(torch.float32), lambda: c.numpy(),
                    lambda: imag.numpy()):
        try:
            attempt()
            refused.append(None)
        except RuntimeError as e:
            refused.append(str(e)[:40])
    imag.mul_(2)
    strided.add_(1j)
    return z, c, imag, strided, c @ z, torch.view_as_real(c.resolve_conj()), flags, tuple(refused)


def p_set_to_nothing(x):
    # x.set_() leaves an empty tensor on a storage of its own; its old views keep the values
    y = x.clone()
    v = y[1:]
    y.set_()
    y.resize_(2).fill_(1)
    return y, v


def p_resize_within_the_storage(x):
    # resize_ (and an out= that must be resized) re-lays a tensor out over its own storage:
    # the base and the other views keep seeing it
    y = x.clone().flatten()
    tail = y[1:]
    torch.add(x[0, :3], 1, out=y[2:4])  # a view resized to three elements writes y[2:5]
    y.resize_(3).mul_(10)
    mid = y.view(3)[1:]
    mid.resize_(4).zero_()  # from offset 1: y's storage elements 1..4
    t = x.clone().t()
    t.resize_(5)  # contiguous from the storage's start, not t's elements in order
    return y, tail, mid, t, y.untyped_storage().nbytes()


def p_resize_grows_the_shared_storage(x):
    # a growing resize_ grows the one storage in place (torch reallocates it): the views made
    # before, of any layout, and the base keep seeing its writes, and it stays one storage
    y = x.clone()
    row, col, flat = y[1], y.t()[:, 2], y.view(-1)
    storage = y.untyped_storage()
    y.resize_(4, 5)
    y.view(-1)[10:].fill_(1)  # (torch leaves the new elements uninitialized)
    col.fill_(2)
    flat.resize_(30)  # a view of the base grows it again; the base and the other views see it
    flat[5:].fill_(3)
    grown = y.untyped_storage() is storage, y.untyped_storage().nbytes()
    return y, row, col, flat, grown


CASES = [
    (p_resize_grows_the_shared_storage, [(3, 4)]),
    (p_resize_within_the_storage, [(3, 4)]),
    (p_set_to_nothing, [(3, 4)]),
    (p_select_add, [(3, 4)]),
    (p_view_setitem, [(3, 4)]),
    (p_t_mul, [(3, 4)]),
    (p_chained, [(3, 4)]),
    (p_stale_view, [(3, 4)]),
    (p_two_views, [(3, 4)]),
    (p_narrow, [(3, 4)]),
    (p_diagonal, [(4, 4)]),
    (p_unfold, [(3, 4)]),
    (p_expand_read, [(3, 4)]),
    (p_as_strided, [(3, 4)]),
    (p_detach_shares, [(3, 4)]),
    (p_data_shares, [(3, 4)]),
    (p_split_chunk_unbind, [(4, 4)]),
    (p_squeeze_unsqueeze, [(3, 4)]),
    (p_bool_mask_setitem, [(3, 4)]),
    (p_index_tensor_setitem, [(3, 4)]),
    (p_index_put_accumulate, [(3, 4)]),
    (p_setitem_on_view, [(3, 4)]),
    (p_copy_across_dtypes, [(3, 4), ((3, 4), torch.int64)]),
    (p_copy_broadcast, [(3, 4)]),
    (p_out_arg, [(3, 4), (3, 4)]),
    (p_set_aliases_source, [(2, 3), (4, 5)]),
    (p_out_into_view, [(3, 4), (3, 4)]),
    (p_dtype_view, [(3, 4)]),
    (p_view_as_real, [((3, 2), torch.complex64)]),
    (p_complex_dtype_views, [((3, 2), torch.complex64), (3, 4)]),
    (p_conj_is_a_view, [((3, 2), torch.complex64)]),
    (p_conj_and_neg_bits, [((4,), torch.complex64)]),
    (p_inplace_unary_on_view, [(3, 4)]),
    (p_transpose_reshape, [(3, 4)]),
    (p_int_inplace, [((3, 4), torch.int64)]),
]


@pytest.mark.parametrize("program,specs", CASES, ids=[c[0].__name__ for c in CASES])
def test_program_matches_torch(program, specs):
    run_both(program, *specs)


def test_view_shares_base_and_metadata():
    x = torch.zeros(3, 4, device="jax")
    y = x[:, 1]
    assert y._base is x
    assert y.stride() == (4,) and y.storage_offset() == 1
    assert x.t().stride() == (1, 4)


def test_inplace_dtype_error_matches_torch():
    x = torch.zeros(3, dtype=torch.int64, device="jax")
    with pytest.raises(RuntimeError, match="can't be cast"):
        x.add_(1.5)


def test_inplace_broadcast_error_matches_torch():
    x = torch.zeros(3, device="jax")
    with pytest.raises(RuntimeError):
        x.add_(torch.ones(2, 3, device="jax"))


def test_write_to_expanded_view_errors_like_torch():
    x = torch.zeros(1, 4, device="jax")
    with pytest.raises(RuntimeError, match="more than one element"):
        x.expand(3, 4).add_(1)
    with pytest.raises(RuntimeError, match="more than one element"):
        x.expand(3, 4).uniform_()


@pytest.mark.parametrize("call", [
    lambda o, a, b: torch.mm(a, b, out=o),
    lambda o, a, b: torch.addmm(o.contiguous(), a, b, out=o),
    lambda o, a, b: torch.addmv(a[:, 0], a, b[:, 0], out=o[:, 0]),
    lambda o, a, b: torch.baddbmm(o[None].contiguous(), a[None], b[None], out=o[None]),
    lambda o, a, b: torch.addbmm(o.contiguous(), a[None], b[None], out=o),
], ids=["mm", "addmm", "addmv", "baddbmm", "addbmm"])
def test_matrix_products_into_an_expanded_out_error_like_torch(call):
    # their out= kernels refuse a written tensor that shows one element twice (one other than their
    # self); mv / bmm / addmv_ do not
    for device in ("cpu", "jax"):
        o = torch.zeros(1, 4, device=device).expand(4, 4)
        with pytest.raises(RuntimeError, match="more than one element"):
            call(o, torch.ones(4, 3, device=device), torch.ones(3, 4, device=device))


def p_inplace_view_ops(x):
    y = x.clone()
    y.unsqueeze_(0)
    y.squeeze_(0)
    y.t_()
    y.transpose_(0, 1)
    return y


def test_inplace_metadata_ops_match_torch():
    run_both(p_inplace_view_ops, (3, 4))


def test_out_argument_is_resized_like_torch():
    out = torch.empty(0, dtype=torch.int64, device="jax")
    torch.arange(0, 5, out=out)
    assert out.tolist() == [0, 1, 2, 3, 4]
    x = torch.arange(6.0, device="jax")
    x.resize_(2, 3)
    assert x.shape == (2, 3) and x.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert x.resize_as_(torch.ones(2, 2, device="jax")) is x and x.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    grown = torch.arange(2.0, device="jax").resize_as_(torch.ones(3, 4, device="jax"))
    assert grown.shape == (3, 4) and grown.flatten()[:2].tolist() == [0.0, 1.0]


def p_set_to_storage_views(x, m):
    # set_ with an offset, size and stride (of a tensor or its storage) views that storage
    w = torch.empty(0, device=x.device).set_(x, 1, (2, 2), (1, 2))
    w.mul_(10)
    v = torch.empty(0, device=x.device).set_(m.untyped_storage(), 2, (2,), (1,))
    v.add_(1)
    z = torch.empty(0, device=x.device).set_(x)
    return w, v, x, m, x.storage().tolist(), m.storage()[4], z.is_set_to(x), w.is_set_to(x)


def test_set_to_storage_views():
    run_both(p_set_to_storage_views, (6,), (2, 3))


def test_set_to_another_dtypes_storage_raises_clearly():
    x, y = torch.zeros(2, device="jax"), torch.arange(6, device="jax")
    with pytest.raises(torch2jax.OpError, match="holds torch.int64 values"):
        x.set_(y.untyped_storage(), 0, (2,))


def test_parametrization_and_distribution_checks_stay_on_the_device():
    # register_parametrization re-points the original parameter with set_ (no host round trip),
    # and torch.distributions' argument checks reduce with _is_all_true
    results = {}
    for device in ("cpu", "jax"):
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 4).to(device)
        with torch2jax.env(fallback="error"):
            layer = torch.nn.utils.parametrizations.orthogonal(linear)
            normal = torch.distributions.Normal(torch.zeros(3, device=device), torch.ones(3, device=device))
            results[device] = (layer.weight, normal.log_prob(torch.ones(3, device=device)))
    for a, e in zip(results["jax"], results["cpu"]):
        torch.testing.assert_close(a.cpu(), e.detach(), atol=1e-5, rtol=1e-5)


# Writes whose target shares memory with an input: torch refuses a partial overlap for
# pointwise ops and copy_, any overlap for the index family; the rest are allowed.
_I = torch.arange(10)
OVERLAP_PROGRAMS = {
    "shift_by_slice_assignment": lambda x: x.__setitem__(slice(1, None), x[:-1]),
    "mask_assignment_from_own_slice": lambda x: x.__setitem__(x > 0, x[:int((x > 0).sum())]),
    "index_assignment_from_own_slice": lambda x: x.__setitem__(_I[5:].to(x.device), x[:5]),
    "index_put_accumulate": lambda x: x.index_put_((_I[:5].to(x.device),), x[2:7], accumulate=True),
    "add_out_shifted": lambda x: torch.add(x[:-1], 1, out=x[1:]),
    "inplace_add_shifted": lambda x: x[1:].add_(x[:-1]),
    "addcmul_shifted": lambda x: x[1:].addcmul_(x[:-1], x[:-1]),
    "clamp_out_shifted": lambda x: torch.clamp(x[:-1], 0, 1, out=x[1:]),
    "index_copy_self": lambda x: x.index_copy_(0, _I.to(x.device), x),
    "scatter_add_partial": lambda x: x.scatter_add_(0, _I[:3].to(x.device), x[1:4]),
    "gather_out_partial": lambda x: torch.gather(x, 0, _I[:3].to(x.device), out=x[1:4]),
    "index_select_out_self": lambda x: torch.index_select(x, 0, _I.to(x.device), out=x),
    "put_partial": lambda x: x.put_(_I[:3].to(x.device), x[1:4]),
    "cat_out_of_own_halves": lambda x: torch.cat([x[:5], x[:5]], out=x),
    "stride_zero_write": lambda x: x.as_strided((3,), (0,)).add_(1),
    # allowed: a full overlap for pointwise ops and copy_, disjoint halves, scalars
    "inplace_add_self": lambda x: x.add_(x),
    "copy_onto_itself": lambda x: x.copy_(x),
    "copy_between_halves": lambda x: x[:5].copy_(x[5:]),
    "flip_onto_itself": lambda x: x.copy_(x.flip(0)),
    "masked_fill_with_own_element": lambda x: x.masked_fill_(x > 0, x[0]),
    "index_fill_with_own_element": lambda x: x.index_fill_(0, _I[:3].to(x.device), x[1]),
    # a view that shows an element twice (unfold with overlap, as_strided, expand): a write
    # through part of it reaches the base, and the stale copies do not undo it
    "unfold_overlapping_row_zeroed": lambda x: x.unfold(0, 4, 2)[0].zero_(),
    "unfold_overlapping_column_scaled": lambda x: x.unfold(0, 3, 1)[:, 1].mul_(0),
    "unfold_2d_patch_filled": lambda x: x.view(2, 5).unfold(1, 2, 1)[1, 2].fill_(-1),
    "as_strided_repeating_setitem": lambda x: x.as_strided((2, 3), (0, 1)).__setitem__((0, 1), 5.0),
    "expand_row_assigned": lambda x: x[:4].expand(3, 4).__setitem__(0, torch.arange(4.0, device=x.device)),
    "expand_filled": lambda x: x[:4].expand(3, 4).fill_(2.0),
    "expand_filled_with_tensor": lambda x: x[:4].expand(3, 4).fill_(torch.tensor(2.0, device=x.device)),
    "expand_index_put": lambda x: x[:4].expand(3, 4).index_put_((_I[:1].to(x.device),), x[9]),
    "expand_index_put_accumulate": lambda x: x[:4].expand(3, 4).index_put_(
        (_I[2:3].to(x.device),), x[9], accumulate=True),
    "expand_masked_fill_one": lambda x: x[:4].expand(3, 4).masked_fill_(
        torch.arange(12, device=x.device).view(3, 4) == 6, 7.0),
    "expand_mask_setitem": lambda x: x[:4].expand(3, 4).__setitem__(
        torch.arange(12, device=x.device).view(3, 4) == 9, 3.0),
    "expand_normal_": lambda x: x[:4].expand(3, 4).normal_(),
    "expand_masked_scatter": lambda x: x[:4].expand(3, 4).masked_scatter_(
        torch.ones(3, 4, dtype=torch.bool, device=x.device), torch.ones(12, device=x.device)),
    # an elementwise op on a view that shows an element k times applies k times, in the
    # order torch's kernel visits the view (its strides and the other operands' decide),
    # and copy_ leaves the value visited last
    "unfold_overlapping_scaled": lambda x: x.unfold(0, 3, 1).mul_(2),
    "unfold_step_2_exp": lambda x: x.unfold(0, 3, 2).exp_(),
    "unfold_overlapping_add_tensor": lambda x: x.unfold(0, 4, 2).add_(torch.arange(16.0, device=x.device).view(4, 4)),
    "unfold_transposed_lerp": lambda x: x.unfold(0, 3, 1).t().lerp_(_W.to(x.device).t(), 0.5),
    "unfold_lerp": lambda x: x.unfold(0, 3, 1).lerp_(_W.to(x.device), 0.5),
    "unfold_copy": lambda x: x.unfold(0, 3, 1).copy_(_W.to(x.device)),
    "unfold_transposed_copy": lambda x: x.unfold(0, 3, 1).t().copy_(_W.to(x.device).t()),
    "as_strided_rows_sub_self": lambda x: x.as_strided((3, 4), (2, 1)).sub_(x.as_strided((3, 4), (2, 1))),
    "as_strided_rows_addcmul": lambda x: x.as_strided((4, 4), (2, 1)).addcmul_(_W[:4, :1].to(x.device), _W[0, :].repeat(2)[:4].to(x.device)),
    "unfold_out_add": lambda x: torch.add(_W.to(x.device), 1, out=x.unfold(0, 3, 1)),
    "unfold_view_read_back": lambda x: x.copy_(x.unfold(0, 3, 1).copy_(_W.to(x.device)).sum(1).repeat(2)[:10]),
    # out= of an indexed reduction, topk, addr and cross into (part of) their own input
    "topk_values_into_the_input": lambda x: torch.topk(x, 3, out=(x[1:4], _I[:3].to(x.device).clone())),
    "max_dim_values_into_the_input": lambda x: torch.max(x.view(2, 5), 1, out=(x[1:3], _I[:2].to(x.device).clone())),
    "median_dim_values_onto_the_input": lambda x: torch.median(
        x[:2].view(2, 1), 1, True, out=(x[:2].view(2, 1), _I[:2].to(x.device).view(2, 1).clone())),
    "kthvalue_onto_the_input": lambda x: torch.kthvalue(
        x[:2].view(2, 1), 1, 1, True, out=(x[:2].view(2, 1), _I[:2].to(x.device).view(2, 1).clone())),
    "cross_onto_its_input": lambda x: torch.linalg.cross(x[:3], x[3:6], out=x[:3]),
    "addr_of_a_row_of_itself": lambda x: x[:9].view(3, 3).addr_(x[:3], _W[0].to(x.device)),
    # ldexp_ multiplies by pow(2, other), a new tensor: an exponent overlapping the input is read first
    "ldexp_by_itself_shifted": lambda x: x[:-1].ldexp_(x[1:]),
    "ldexp_out_onto_its_input_shifted": lambda x: torch.ldexp(x[:-1], _W[0, :1].to(x.device), out=x[1:]),
}
_W = torch.arange(24.0).view(8, 3).mul(0.5).sin()


@pytest.mark.parametrize("name", sorted(OVERLAP_PROGRAMS))
def test_overlapping_writes_match_torch(name):
    program = OVERLAP_PROGRAMS[name]
    cpu = torch.randn(10, generator=torch.Generator().manual_seed(0))
    jx = cpu.to("jax")
    try:
        program(cpu)
    except RuntimeError as e:
        with pytest.raises(RuntimeError) as caught:
            program(jx)
        assert str(caught.value) == str(e)
        return
    program(jx)
    torch.testing.assert_close(jx.cpu(), cpu)


@pytest.mark.parametrize("name", ["unfold_overlapping_row_zeroed", "expand_index_put", "expand_masked_fill_one",
                                  "unfold_transposed_lerp", "unfold_out_add"])
def test_writes_through_repeating_views_under_jit(name):
    program = OVERLAP_PROGRAMS[name]

    def run(x):
        program(x)
        return x

    cpu = torch.randn(10, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch2jax.jit(run)(cpu.to("jax")).cpu(), run(cpu.clone()))


def test_overlap_check_under_jit():
    @torch2jax.jit
    def shift(x):
        x[1:] = x[:-1]
        return x

    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        shift(torch.randn(6, device="jax"))


# Result layouts: torch lays the result of a pointwise op, clone, the *_like factories,
# cat, batch norm or a convolution out like its (non-contiguous) inputs, which decides
# the strides users read and which later .view() calls are legal.
def _channels_last(dev):
    return torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0)).to(dev).to(
        memory_format=torch.channels_last)


LAYOUT_PROGRAMS = {
    "transposed_pointwise_then_view": lambda dev: (torch.arange(6., device=dev).reshape(2, 3).t() * 2).t().view(-1),
    "channels_last_relu_nhwc_view": lambda dev: torch.relu(_channels_last(dev)).permute(0, 2, 3, 1).view(-1, 3),
    "channels_last_clone": lambda dev: _channels_last(dev).clone(),
    "channels_last_empty_like": lambda dev: torch.zeros_like(_channels_last(dev)),
    "channels_last_cat": lambda dev: torch.cat([_channels_last(dev)] * 2, 1),
    "channels_last_broadcast_add": lambda dev: _channels_last(dev) + torch.ones(5, device=dev),
    "contiguous_first_operand_wins": lambda dev: _channels_last(dev).contiguous() + _channels_last(dev),
    "channels_last_to_float64": lambda dev: _channels_last(dev).double(),
    "channels_last_contiguous": lambda dev: _channels_last(dev).contiguous(),
    "empty_channels_last": lambda dev: torch.empty(2, 3, 4, 5, device=dev, memory_format=torch.channels_last).zero_(),
    "channels_last_conv_and_batch_norm": lambda dev: torch.nn.BatchNorm2d(4).to(dev)(
        torch.nn.Conv2d(3, 4, 3).to(dev).to(memory_format=torch.channels_last)(_channels_last(dev))),
    "channels_last_max_pool": lambda dev: F.max_pool2d(_channels_last(dev), 2, return_indices=True)[1],
    "channels_last_avg_pool": lambda dev: F.avg_pool2d(_channels_last(dev), 2),
    "channels_last_adaptive_avg_pool": lambda dev: F.adaptive_avg_pool2d(_channels_last(dev), 3),
    "channels_last_upsample_nearest": lambda dev: F.interpolate(_channels_last(dev), scale_factor=2),
    "channels_last_upsample_bilinear": lambda dev: F.interpolate(_channels_last(dev), scale_factor=2, mode="bilinear"),
    "channels_last_constant_pad": lambda dev: F.pad(_channels_last(dev), (1, 1, 1, 1)),
    "channels_last_reflection_pad": lambda dev: F.pad(_channels_last(dev), (1, 1, 1, 1), mode="reflect"),
    "channels_last_group_norm": lambda dev: F.group_norm(_channels_last(dev), 3),
    "channels_last_roll": lambda dev: _channels_last(dev).roll(1, 0),
    "channels_last_3d_max_pool": lambda dev: F.max_pool3d(
        torch.randn(2, 3, 4, 4, 4, generator=torch.Generator().manual_seed(0)).to(dev).to(
            memory_format=torch.channels_last_3d), 2),
    "transposed_sort": lambda dev: torch.arange(20.0, device=dev).reshape(4, 5).t().sort(-1, descending=True).values,
    "transposed_flip": lambda dev: torch.arange(20.0, device=dev).reshape(4, 5).t().flip(0),
    "transposed_roll_is_contiguous": lambda dev: torch.arange(20.0, device=dev).reshape(4, 5).t().roll(1, 0),
    "cpu_transposed_to_device": lambda dev: torch.arange(12.0).reshape(3, 4).t().to(dev),
    "cpu_channels_last_to_device": lambda dev: torch.arange(96.0).reshape(2, 3, 4, 4).to(
        memory_format=torch.channels_last).to(dev),
    "transposed_to_cpu": lambda dev: torch.arange(12.0, device=dev).reshape(3, 4).t().cpu(),
    "empty_strided": lambda dev: torch.empty_strided((2, 3), (1, 2), device=dev).fill_(1),
    "channels_last_channel_shuffle": lambda dev: F.channel_shuffle(_channels_last(dev)[:, :2], 2),
    "channels_last_glu": lambda dev: F.glu(_channels_last(dev)[:, :2], 1),
    "channels_last_glu_last_dim": lambda dev: F.glu(_channels_last(dev)[..., :4], -1),
    "channels_last_prelu": lambda dev: F.prelu(_channels_last(dev), torch.full((3,), 0.1, device=dev)),
    "channels_last_hardswish": lambda dev: F.hardswish(_channels_last(dev)),
    "channels_last_max_unpool": lambda dev: F.max_unpool2d(*F.max_pool2d(_channels_last(dev), 2, return_indices=True),
                                                           2, output_size=(4, 5)),
    "channels_last_stack": lambda dev: torch.stack([_channels_last(dev)] * 2, 1),
    "channels_last_index_put": lambda dev: _channels_last(dev).index_put((torch.tensor([1], device=dev),),
                                                                         torch.tensor(0.0, device=dev)),
    "channels_last_index_fill": lambda dev: _channels_last(dev).index_fill(1, torch.tensor([0], device=dev), 0.0),
    "channels_last_mse_loss": lambda dev: F.mse_loss(_channels_last(dev), torch.zeros(2, 3, 4, 5, device=dev),
                                                     reduction="none"),
    "channels_last_huber_loss": lambda dev: F.huber_loss(_channels_last(dev), torch.zeros(2, 3, 4, 5, device=dev),
                                                         reduction="none"),
    "channels_last_bce_logits": lambda dev: F.binary_cross_entropy_with_logits(
        _channels_last(dev), torch.full((2, 3, 4, 5), 0.5, device=dev), reduction="none"),
    "channels_last_polar_as_real": lambda dev: torch.view_as_real(torch.polar(_channels_last(dev).abs(),
                                                                              _channels_last(dev))),
    "channels_last_complex_angle_is_contiguous": lambda dev: torch.complex(*[_channels_last(dev)] * 2).angle(),
}


@pytest.mark.parametrize("name", sorted(LAYOUT_PROGRAMS))
def test_result_layout_matches_torch(name):
    torch.manual_seed(0)
    expected = LAYOUT_PROGRAMS[name]("cpu")
    torch.manual_seed(0)
    actual = LAYOUT_PROGRAMS[name]("jax")
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_result_layout_under_jit_and_autograd():
    x = torch.randn(3, 4, device="jax", requires_grad=True)

    @torch2jax.jit
    def f(x):
        y = torch.tanh(x.t())
        return y.stride(), y.t().view(-1) * 2

    stride, out = f(x)
    assert stride == (1, 4)
    out.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * (1 - torch.tanh(x.detach().cpu()) ** 2))


def _strided_layouts(d):
    out = []
    x = torch.empty_strided((2, 3), (1, 4), device=d)  # gaps: storage of 10 elements
    out.append((x.untyped_storage().nbytes(), x.as_strided((10,), (1,)).shape))
    y = torch.empty_strided((3, 3), (1, 1), device=d)  # overlaps: y[0, 1] is y[1, 0]
    y.zero_()
    y[0, 1] = 5
    out.append((y[1, 0].item(), y.untyped_storage().nbytes(), y.stride()))
    z = torch.empty_strided((4,), (2,), device=d).fill_(1)
    out.append((z.untyped_storage().nbytes(), z.stride(), z.sum().item()))
    w = torch.empty_strided((2, 0, 3), (5, 7, 1), device=d)
    n = torch.ones(2, device=d).new_empty_strided((2, 2), (3, 1))
    out.append((w.untyped_storage().nbytes(), w.stride(), n.untyped_storage().nbytes(), n.stride()))
    r = torch.zeros(1, device=d).resize_(2, 3, 4, 5, memory_format=torch.channels_last)
    r2 = torch.arange(120.0, device=d).reshape(2, 3, 4, 5).resize_(2, 3, 4, 5, memory_format=torch.channels_last)
    out.append((r.stride(), r2.stride(), r2[0, 1, 0, :3].tolist()))
    return out


def test_empty_strided_with_gaps_or_overlaps_and_resize_memory_format():
    assert _strided_layouts("jax") == _strided_layouts("cpu")


_SPD = torch.tensor([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]])
_RHS = torch.tensor([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0], [1.0, 1.0], [2.0, -2.0]])


@pytest.mark.parametrize("name, fn", [
    ("inv", lambda a: (torch.linalg.inv(a),)),
    ("cholesky", lambda a: (torch.linalg.cholesky(a),)),
    ("qr", lambda a: torch.linalg.qr(a)),
    ("eigh", lambda a: torch.linalg.eigh(a)),
    ("eig", lambda a: torch.linalg.eig(a)),
    ("svd", lambda a: torch.linalg.svd(a)),
    ("svd_wide", lambda a: torch.linalg.svd(a[..., :2, :], full_matrices=False)),
    ("lu_factor", lambda a: torch.linalg.lu_factor(a)),
    ("solve", lambda a: (torch.linalg.solve(a, a[..., :2]),)),
    ("lstsq_tall", lambda a: (torch.linalg.lstsq(torch.cat([a, a[..., :2, :]], -2),
                                                 _RHS.expand(*a.shape[:-2], 5, 2).to(a.device))[0],)),
    ("cholesky_inverse", lambda a: (torch.cholesky_inverse(a),)),
    ("Tensor.cholesky", lambda a: (a.cholesky(), a.cholesky(upper=True))),
    ("geqrf", lambda a: torch.geqrf(a)),
    ("geqrf_wide", lambda a: torch.geqrf(a[..., :2, :])),
])
@pytest.mark.parametrize("batched", [False, True])
def test_lapack_results_are_column_major_as_on_the_cpu(name, fn, batched):
    a = torch.stack([_SPD, 2 * _SPD]) if batched else _SPD
    want, got = fn(a), fn(a.to("jax"))
    assert [t.stride() for t in got] == [t.stride() for t in want]
    for w, g in zip(want, got):
        if w.dim() >= 2 and not w.is_contiguous():  # torch.linalg.inv(A).view(-1) is an error on both
            with pytest.raises(RuntimeError, match="view size is not compatible"):
                g.view(-1)


@pytest.mark.parametrize("view", [lambda z: z[0], lambda z: z.t(), lambda z: z.view(-1),
                                  lambda z: z.narrow(1, 0, 2), lambda z: z.split(1)[0]])
def test_views_of_an_inference_tensor_are_inference_tensors(view):
    results = {}
    for device in ("cpu", "jax"):
        with torch.inference_mode():
            z = torch.ones(2, 3, device=device)
        v = view(z)
        errors = []
        for bad in (lambda: v.add_(1), lambda: (v * torch.ones(v.shape, device=device, requires_grad=True)).sum()
                    .backward()):
            try:
                bad()
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e).split(".")[0])
        results[device] = (v.is_inference(), errors, z.tolist())
    assert results["jax"] == results["cpu"]
    assert results["cpu"][0] and None not in results["cpu"][1]


@pytest.mark.parametrize("write", [
    lambda x: x.view(8, 3)[:, :1].expand(8, 0).mul_(2),  # a zero-size expanded view: no element twice
    lambda x: x.view(4, 6).unfold(0, 2, 1)[:, :0].mul_(2),
    lambda x: x.view(4, 6)[:0].unsqueeze(0).expand(2, 0, 6).clamp_(max=0.1),
    lambda x: x.view(4, 6)[:, 2:2].copy_(torch.ones(4, 0, device=x.device)),
], ids=["expand", "unfold", "clamp", "copy"])
def test_writes_into_zero_size_views_write_nothing(write):
    for device in ("cpu", "jax"):
        x = torch.arange(24.0, device=device)
        before = x._version
        write(x)
        assert x.cpu().tolist() == list(map(float, range(24))) and x._version > before


@pytest.mark.parametrize("op", ["sum", "prod", "mean", "cumsum", "cumprod"])
def test_a_dtype_argument_and_an_out_of_another_dtype_raise(op):
    fn = getattr(torch, op)
    for device in ("cpu", "jax"):
        x = torch.ones(3, 2, device=device)
        out = torch.zeros((3, 2) if op.startswith("cum") else (2,), device=device)
        with pytest.raises(RuntimeError, match="dtype"):
            fn(x, 0, dtype=torch.float64, out=out)
        fn(x, 0, dtype=torch.float32, out=out)  # (the same dtype: written)
        assert out.sum().item() > 0


@pytest.mark.parametrize("op", [
    lambda x, c, o: torch.add(x, 1, out=o), lambda x, c, o: torch.neg(x, out=o),
    lambda x, c, o: torch.mm(x, x.t(), out=o), lambda x, c, o: torch.cumsum(x, 0, out=o),
    lambda x, c, o: torch.exp(c, out=o), lambda x, c, o: torch.mul(c, c, out=o),
    lambda x, c, o: torch.linalg.inv(x[:3], out=o), lambda x, c, o: torch.cat([x, x], 1, out=o),
], ids=["add", "neg", "mm", "cumsum", "exp_channels_last", "mul_channels_last", "inv", "cat"])
def test_an_out_the_op_resizes_takes_the_result_s_layout(op):
    # as torch: a resized out= tensor is laid out as the op's result would be (a transposed input's
    # elementwise result is transposed, a channels_last one stays channels_last)
    def run(device):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 4, generator=g).to(device).t()
        c = torch.randn(1, 2, 3, 3, generator=g).to(device).contiguous(memory_format=torch.channels_last)
        o = torch.empty(5, device=device)
        with pytest.warns(UserWarning, match="was resized"):
            op(x, c, o)
        return o.stride(), o.cpu()

    (got_stride, got), (want_stride, want) = run("jax"), run("cpu")
    assert got_stride == want_stride
    torch.testing.assert_close(got, want)


def test_slice_inverse_is_a_view_with_the_base_s_layout():
    # functionalization's inverse of slice: the slice's storage seen as the base (was a raw AttributeError)
    def run(device):
        x = torch.arange(12.0).reshape(3, 4).to(device)
        v = torch.ops.aten.slice_inverse(x[1:], x, 0, 1, None, 1)
        w = torch.ops.aten.slice_inverse(x[:, ::2], x, 1, None, None, 2)
        v.mul_(2)
        return v.shape, v.stride(), v.storage_offset(), w.stride(), x.tolist(), w.tolist()

    assert run("jax") == run("cpu")


@pytest.mark.parametrize("base, written, read", [(torch.int32, torch.int8, torch.int16),
                                                 (torch.int64, torch.int16, torch.int8)])
def test_dtype_views_of_different_widths_written_then_read_under_jit(base, written, read):
    # XLA's simplifier folded the narrowing bitcast of the read into the widening one of the write-back,
    # giving a bitcast the HLO verifier refused (a raw XLA error)
    def program(a):
        a.view(written).neg_()
        return a.view(read) + 1

    x = torch.arange(32, dtype=torch.uint8).mul(37).view(base)
    assert torch.equal(torch2jax.jit(program)(x.to("jax")).cpu(), program(x.clone()))


def test_dtype_views_restrided_resized_and_written_like_torch():
    # as_strided / unfold / resize_ of a view(dtype) count elements of the view's dtype over the
    # storage's bytes (they raised an error naming the op)
    def program(device):
        a = torch.arange(12, dtype=torch.float16, device=device)
        w = a[:10].view(torch.int32).as_strided((2, 2), (2, 1), 1)
        w.add_(3)
        b = torch.arange(7, dtype=torch.int16, device=device)
        b[:6].view(torch.float32).as_strided((2,), (1,), 1).zero_()
        u = torch.arange(6.0, device=device).view(torch.int16).unfold(0, 4, 3)
        u[1].fill_(5)
        v = torch.arange(8.0, device=device).view(torch.int32)
        v.resize_(12)
        v[8:] = 7
        return [t.cpu() for t in (a, w, b, u, v[:10])]

    for got, want in zip(program("jax"), program("cpu")):
        assert got.dtype == want.dtype and torch.equal(got, want)
