"""Random ops on the jax device: distributions, dtypes, ranges and seeding.

Values cannot be compared with torch CPU (the bit streams differ), so these
tests check the statistics of large samples against the distributions torch
documents, with tolerances of several standard errors; every test seeds the
generator first, so it is deterministic.
"""

from __future__ import annotations

import functools
import math
import pickle
import random
import re

import numpy as np
import pytest
import torch
from scipy import stats

import torch2jax
import torch2jax as t2j

N = 100_000


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(1234)


def host(t):
    return t.cpu().double().numpy()


def assert_moments(x, mean, std, n_se=6):
    """Sample mean and std within ``n_se`` standard errors of the expected values."""
    x = host(x).ravel()
    n = x.size
    assert abs(x.mean() - mean) < n_se * std / math.sqrt(n), (x.mean(), mean)
    # standard error of the sample std is about std / sqrt(2n) for light tails
    assert abs(x.std() - std) < n_se * std * math.sqrt(2 / n) + 1e-3 * std, (x.std(), std)


def chi2_ok(counts, probs, alpha=1e-6):
    counts = np.asarray(counts, dtype=np.float64)
    expected = counts.sum() * np.asarray(probs, dtype=np.float64)
    stat = ((counts - expected) ** 2 / expected).sum()
    return stat < stats.chi2.ppf(1 - alpha, len(counts) - 1)


# -- continuous distributions -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_randn(dtype):
    x = torch.randn(N, device="jax", dtype=dtype)
    assert x.dtype == dtype and x.shape == (N,)
    assert_moments(x, 0.0, 1.0, n_se=6 if dtype != torch.bfloat16 else 30)


def test_normal_in_place_and_functional():
    x = torch.empty(N, device="jax").normal_(3.0, 2.0)
    assert_moments(x, 3.0, 2.0)
    y = torch.normal(-1.0, 0.5, (N,), device="jax")
    assert_moments(y, -1.0, 0.5)


def test_normal_tensor_mean_and_std():
    mean = torch.cat([torch.zeros(N // 2), torch.full((N // 2,), 10.0)]).to("jax")
    std = torch.cat([torch.ones(N // 2), torch.full((N // 2,), 3.0)]).to("jax")
    x = torch.normal(mean, std)
    assert x.shape == mean.shape and x.dtype == torch.float32
    assert_moments(x[: N // 2], 0.0, 1.0)
    assert_moments(x[N // 2 :], 10.0, 3.0)
    assert_moments(torch.normal(mean[N // 2 :], 2.0), 10.0, 2.0)
    assert_moments(torch.normal(5.0, std[: N // 2]), 5.0, 1.0)


def test_randn_complex_has_unit_variance():
    z = torch.randn(N, device="jax", dtype=torch.complex64)
    assert z.dtype == torch.complex64
    assert_moments(z.real, 0.0, math.sqrt(0.5))
    assert_moments(z.imag, 0.0, math.sqrt(0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_rand(dtype):
    x = torch.rand(N, device="jax", dtype=dtype)
    assert x.dtype == dtype
    v = host(x)
    assert v.min() >= 0 and v.max() <= 1
    assert_moments(x, 0.5, math.sqrt(1 / 12), n_se=6 if dtype != torch.float16 else 20)


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 24), (torch.float64, 53)])
@pytest.mark.parametrize("jit", [False, True])
def test_rand_steps_are_torchs(dtype, bits, jit):
    """torch's CPU kernel draws multiples of 2**-24 (2**-53 for float64): half of them odd multiples,
    which a sampler with steps of 2**-23 (jax.random.uniform's) never draws."""
    draw = functools.partial(torch.rand, 100_000, dtype=dtype, device="jax")
    steps = host((t2j.jit(draw) if jit else draw)()).astype(np.float64) * 2.0 ** bits
    assert np.all(steps == np.round(steps))
    assert 0.48 < np.mean(steps % 2 == 1) < 0.52


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("low,high", [(0.0, 1.0), (2.0, 3.0)])
def test_half_precision_uniform_stays_below_high(dtype, low, high):
    """float32 samples round to ``high`` in half precision; torch gives ``low`` instead, so the
    mean sits below the midpoint by about that mass (e.g. 0.498 for bfloat16 rand)."""
    n = 1_000_000
    x = torch.empty(n, device="jax", dtype=dtype).uniform_(low, high)
    ref = torch.empty(n, dtype=dtype).uniform_(low, high)
    v = host(x).astype(np.float64)
    assert v.min() >= low and v.max() < high
    assert abs(v.mean() - ref.double().mean().item()) < 6 * (high - low) / math.sqrt(12 * n)


def test_uniform_range():
    x = torch.empty(N, device="jax").uniform_(-2.0, 5.0)
    v = host(x)
    assert v.min() >= -2 and v.max() < 5
    assert_moments(x, 1.5, 7 / math.sqrt(12))
    # ten equal bins are equally likely
    assert chi2_ok(np.histogram(v, bins=10, range=(-2, 5))[0], [0.1] * 10)


def test_exponential():
    x = torch.empty(N, device="jax").exponential_(4.0)
    assert host(x).min() >= 0
    assert_moments(x, 0.25, 0.25, n_se=10)


def test_log_normal_and_cauchy():
    x = torch.empty(N, device="jax").log_normal_(0.5, 0.25)
    assert_moments(torch.log(x.cpu()), 0.5, 0.25)
    c = host(torch.empty(N, device="jax").cauchy_(2.0, 3.0))
    # Cauchy has no moments: check the median and the quartiles (median -+ sigma)
    q1, med, q3 = np.quantile(c, [0.25, 0.5, 0.75])
    assert abs(med - 2.0) < 0.05 and abs(q1 + 1.0) < 0.08 and abs(q3 - 5.0) < 0.08


def test_geometric_and_poisson():
    g = torch.empty(N, device="jax").geometric_(0.25)
    v = host(g)
    assert v.min() >= 1 and np.all(v == np.round(v))
    assert_moments(g, 4.0, math.sqrt(0.75) / 0.25, n_se=10)
    rates = torch.full((N,), 3.5, device="jax")
    p = torch.poisson(rates)
    assert p.dtype == torch.float32 and np.all(host(p) == np.round(host(p)))
    assert_moments(p, 3.5, math.sqrt(3.5), n_se=10)


def test_standard_gamma_and_dirichlet():
    alpha = torch.full((N,), 2.5, device="jax")
    g = torch._standard_gamma(alpha)
    assert_moments(g, 2.5, math.sqrt(2.5), n_se=10)
    d = torch._sample_dirichlet(torch.tensor([[1.0, 2.0, 7.0]] * 20_000, device="jax"))
    np.testing.assert_allclose(host(d).sum(-1), 1, rtol=1e-5)
    np.testing.assert_allclose(host(d).mean(0), [0.1, 0.2, 0.7], atol=0.01)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dirichlet_grad_matches_torch_on_samples(dtype):
    # torch's kernel is a fitted approximation (within ~1e-3 of the exact derivative ours computes in
    # float64, ~1e-2 in float32), so the comparison is on points drawn from the distribution, at that tolerance
    a = torch.exp(torch.randn(4000, dtype=torch.float64) * 2)
    total = a + torch.exp(torch.randn(4000, dtype=torch.float64) * 2)
    x = torch.distributions.Beta(a, total - a).sample().clamp(1e-30, 1 - 1e-7)
    args = [v.to(dtype) for v in (x, a, total)]
    got = torch._dirichlet_grad(*[v.to("jax") for v in args])
    assert got.dtype == dtype
    np.testing.assert_allclose(host(got), torch._dirichlet_grad(*args).double().numpy(),
                               rtol=3e-3 if dtype == torch.float64 else 1e-2, atol=1e-30)
    # the limits torch takes at the ends of the interval
    ends = [torch.tensor([0.0, 1.0], dtype=dtype), torch.tensor([3.0, 3.0], dtype=dtype),
            torch.tensor([3.5, 3.5], dtype=dtype)]
    np.testing.assert_allclose(host(torch._dirichlet_grad(*[v.to("jax") for v in ends])),
                               torch._dirichlet_grad(*ends).double().numpy(), rtol=1e-3)


def test_dirichlet_grad_is_exact_where_the_beta_cdf_is_closed_form():
    # Beta(a, 1): I_x = x^a, so -dI/da / pdf / (1 - x) = -x log(x) / (a (1 - x))
    x = torch.tensor([1e-6, 0.01, 0.3, 0.5, 0.9, 0.999], dtype=torch.float64)
    a = torch.tensor([0.05, 0.5, 2.0, 7.0, 30.0, 400.0], dtype=torch.float64)
    got = torch._dirichlet_grad(x.to("jax"), a.to("jax"), (a + 1).to("jax"))
    np.testing.assert_allclose(host(got), (-x * x.log() / (a * (1 - x))).numpy(), rtol=1e-9)


def test_dirichlet_grad_refuses_what_torch_refuses():
    half = [torch.tensor([0.3], dtype=torch.float16, device="jax")] * 3
    with pytest.raises(NotImplementedError, match="_dirichlet_grad_cpu.*Half"):
        torch._dirichlet_grad(*half)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch._dirichlet_grad(torch.tensor([0.3], device="jax"), torch.tensor([2.0], dtype=torch.float64,
                                                                               device="jax"),
                              torch.tensor([3.0], device="jax"))


def test_beta_rsample_backward_inside_jit_is_one_program():
    import torch2jax as t2j

    a = torch.tensor([2.0, 3.0], device="jax", requires_grad=True)
    b = torch.tensor([1.5, 0.5], device="jax", requires_grad=True)

    @t2j.jit(fullgraph=True)
    def step(a, b):
        x = torch.distributions.Beta(a, b).rsample((20_000,))
        x.mean(0).sum().backward()

    step(a, b)
    # d E[x] / da = b / (a + b)^2, d E[x] / db = -a / (a + b)^2: the pathwise gradient is unbiased
    ea, eb = host(a.detach()), host(b.detach())
    np.testing.assert_allclose(host(a.grad), eb / (ea + eb) ** 2, rtol=0.05)
    np.testing.assert_allclose(host(b.grad), -ea / (ea + eb) ** 2, rtol=0.05)

# -- discrete distributions ---------------------------------------------------


def test_bernoulli():
    x = torch.bernoulli(torch.full((N,), 0.3, device="jax"))
    assert x.dtype == torch.float32 and set(np.unique(host(x))) <= {0.0, 1.0}
    assert abs(host(x).mean() - 0.3) < 6 * math.sqrt(0.21 / N)
    p = torch.tensor([0.0, 1.0] * 1000, device="jax")
    np.testing.assert_array_equal(host(torch.bernoulli(p)), host(p))
    y = torch.empty(N, dtype=torch.int64, device="jax").bernoulli_(0.8)
    assert y.dtype == torch.int64 and abs(host(y).mean() - 0.8) < 6 * math.sqrt(0.16 / N)


def test_randint_range_and_uniformity():
    x = torch.randint(-3, 7, (N,), device="jax")
    assert x.dtype == torch.int64
    v = host(x)
    assert v.min() == -3 and v.max() == 6
    assert chi2_ok(np.bincount((v + 3).astype(int), minlength=10), [0.1] * 10)
    y = torch.randint_like(torch.empty(1000, dtype=torch.int32, device="jax"), 5)
    assert y.dtype == torch.int32 and set(np.unique(host(y))) == set(range(5))


def test_random_defaults_follow_dtype():
    b = host(torch.empty(1000, dtype=torch.bool, device="jax").random_())
    assert set(np.unique(b)) == {0, 1}
    u8 = host(torch.empty(N, dtype=torch.uint8, device="jax").random_())
    assert u8.min() == 0 and u8.max() == 255
    f = host(torch.empty(N, device="jax").random_())
    assert f.min() >= 0 and f.max() <= 2**24 and np.all(f == np.round(f)) and f.max() > 2**23
    h = host(torch.empty(N, dtype=torch.bfloat16, device="jax").random_())
    assert h.min() >= 0 and h.max() <= 2**8
    i64 = torch.empty(1000, dtype=torch.int64, device="jax").random_()
    assert i64.dtype == torch.int64 and i64.cpu().min() >= 0 and i64.cpu().max() > 2**40
    r = host(torch.empty(N, device="jax").random_(5, 9))
    assert set(np.unique(r)) == {5, 6, 7, 8}
    with pytest.raises(RuntimeError, match="from"):
        torch.empty(3, device="jax").random_(5, 3)


def test_randperm():
    p = torch.randperm(1000, device="jax")
    assert p.dtype == torch.int64
    assert sorted(p.cpu().tolist()) == list(range(1000))
    assert not torch.equal(p.cpu(), torch.arange(1000))


def test_multinomial_with_replacement():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], device="jax")
    s = torch.multinomial(probs, 50_000, replacement=True)
    assert s.dtype == torch.int64 and s.shape == (50_000,)
    counts = np.bincount(host(s).astype(int), minlength=4)
    assert counts[1] == 0
    assert chi2_ok(counts[[0, 2, 3]], [0.1, 0.6, 0.3])
    batched = torch.multinomial(torch.tensor([[1.0, 0.0], [0.0, 2.0]], device="jax"), 10, replacement=True)
    assert batched.shape == (2, 10) and torch.equal(batched.cpu(), torch.tensor([[0] * 10, [1] * 10]))


def test_multinomial_without_replacement():
    weights = torch.tensor([1.0, 2.0, 0.0, 4.0, 3.0], device="jax").expand(4000, 5).contiguous()
    s = host(torch.multinomial(weights, 3))
    assert s.shape == (4000, 3)
    assert all(len(set(row)) == 3 for row in s.astype(int).tolist())
    assert not np.any(s == 2)
    # the first draw follows the normalized weights
    assert chi2_ok(np.bincount(s[:, 0].astype(int), minlength=5)[[0, 1, 3, 4]], [0.1, 0.2, 0.4, 0.3])


# -- seeding --------------------------------------------------------------------


def test_manual_seed_reproduces_draws():
    def draws():
        return [
            torch.randn(5, device="jax").cpu(),
            torch.rand(5, device="jax").cpu(),
            torch.randint(0, 100, (5,), device="jax").cpu(),
        ]

    torch.manual_seed(7)
    a = draws()
    torch.manual_seed(7)
    b = draws()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    torch.manual_seed(8)
    assert not torch.equal(torch.randn(5, device="jax").cpu(), a[0])


def test_manual_seed_inside_jit_reseeds_every_call():
    def draw(x):
        torch.manual_seed(7)
        return x + torch.randn_like(x)

    x = torch.zeros(3, device="jax")
    eager = draw(x).cpu()
    after_eager = torch.randn(2, device="jax").cpu()
    jitted = torch2jax.jit(draw)
    for _ in range(3):
        assert torch.equal(jitted(x).cpu(), eager)
        # the generator continues from the seed, as after the eager call
        assert torch.equal(torch.randn(2, device="jax").cpu(), after_eager)


def test_consecutive_draws_differ():
    x = torch.randn(100, device="jax").cpu()
    y = torch.randn(100, device="jax").cpu()
    assert not torch.equal(x, y)
    t = torch.empty(100, device="jax")
    assert not torch.equal(t.uniform_().cpu(), t.clone().uniform_().cpu())


def test_generators_with_same_seed_give_same_stream():
    g1 = torch.Generator().manual_seed(99)
    g2 = torch.Generator().manual_seed(99)
    a = torch.randn(8, device="jax", generator=g1).cpu()
    b = torch.randn(8, device="jax", generator=g2).cpu()
    assert torch.equal(a, b)
    # an unrelated draw from the default generator does not disturb them
    torch.randn(8, device="jax")
    other = torch.Generator().manual_seed(100)
    assert not torch.equal(torch.randn(8, device="jax", generator=other).cpu(), a)


def test_generator_consecutive_draws_differ():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(8, device="jax", generator=g).cpu()
    b = torch.randn(8, device="jax", generator=g).cpu()
    assert not torch.equal(a, b)
    g.manual_seed(5)
    assert torch.equal(torch.randn(8, device="jax", generator=g).cpu(), a)


def test_jax_generator_draws_what_the_default_generator_draws_after_the_same_seed():
    """As on CUDA: ``Generator(device).manual_seed(s)`` and ``torch.manual_seed(s)`` give one stream."""
    torch.manual_seed(7)
    default = [torch.randn(5, device="jax").cpu(), torch.rand(3, device="jax").cpu(),
               torch.randint(0, 9, (4,), device="jax").cpu()]
    g = torch.Generator(device="jax").manual_seed(7)
    own = [torch.randn(5, device="jax", generator=g).cpu(), torch.rand(3, device="jax", generator=g).cpu(),
           torch.randint(0, 9, (4,), device="jax", generator=g).cpu()]
    assert all(torch.equal(a, b) for a, b in zip(default, own))
    assert g.initial_seed() == 7 and g.device == torch.device("jax", 0)


def test_jax_generator_state_round_trips_and_pickles():
    g = torch.Generator(device="jax").manual_seed(11)
    torch.randn(2, device="jax", generator=g)
    state = g.get_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    assert state.shape == torch.jax.get_rng_state().shape  # one format for both kinds of generator
    a = torch.randn(6, device="jax", generator=g).cpu()
    assert torch.equal(g.set_state(state).get_state(), state)
    assert torch.equal(torch.randn(6, device="jax", generator=g).cpu(), a)
    g.set_state(state)
    copy = pickle.loads(pickle.dumps(g))
    assert copy.initial_seed() == 11
    assert torch.equal(torch.randn(6, device="jax", generator=copy).cpu(), a)
    # the default generator's state drives a jax Generator too
    torch.jax.set_rng_state(state)
    assert torch.equal(torch.randn(6, device="jax").cpu(), a)
    with pytest.raises(TypeError, match=r"Generator.set_state: expected .* torch.uint8 tensor of 16 bytes"):
        g.set_state(torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"Generator.set_state: expected .* got a torch.uint8 tensor of 3"):
        g.set_state(torch.zeros(3, dtype=torch.uint8))  # (a wrong size: torch's CPU generator's error type)
    with pytest.raises(RuntimeError, match="torch.Generator: device jax:1 does not exist"):
        torch.Generator(device="jax:1")


def test_dropout_mask_differs_between_calls():
    x = torch.ones(1000, device="jax")
    a = torch.nn.functional.dropout(x, 0.5, training=True).cpu()
    b = torch.nn.functional.dropout(x, 0.5, training=True).cpu()
    assert not torch.equal(a, b)
    assert set(np.unique(a.numpy())) <= {0.0, 2.0}
    assert abs((a == 0).double().mean().item() - 0.5) < 0.1


def _fork_rng_draws(x):
    with torch.random.fork_rng(device_type="jax"):
        inside = torch.rand(3, device="jax")
    return inside, torch.rand(3, device="jax")


def _get_set_rng_state_draws(x):
    state = torch.jax.get_rng_state()
    first = torch.rand(3, device="jax")
    torch.jax.set_rng_state(state)
    return first, torch.rand(3, device="jax")


@pytest.mark.parametrize("fn", [_fork_rng_draws, _get_set_rng_state_draws])
@pytest.mark.parametrize("jit", [False, True])
def test_rng_state_restored_inside_a_function_repeats_its_draws(fn, jit):
    import torch2jax as t2j

    f = t2j.jit(fn) if jit else fn
    torch.manual_seed(0)
    a, b = f(torch.zeros(1, device="jax"))
    assert a.tolist() == b.tolist()
    c, _ = f(torch.zeros(1, device="jax"))
    assert c.tolist() != a.tolist()  # the stream outside goes on from call to call


def test_reentrant_checkpoint_replays_dropout_masks_under_jit():
    """torch's reentrant checkpoint stashes the RNG state and restores it for the recompute:
    the recomputed dropout mask must be the forward's, or the gradient is wrong."""
    import torch.nn.functional as F

    import torch2jax as t2j

    def step(x):
        y = torch.utils.checkpoint.checkpoint(lambda v: F.dropout(v, 0.5, True) * v, x, use_reentrant=True)
        y.sum().backward()
        return y, x.grad

    x = (torch.rand(64) + 1).to("jax").requires_grad_()
    y, grad = t2j.jit(step)(x)
    torch.testing.assert_close(grad.cpu(), (2 * y / x).detach().cpu())


_SAMPLERS = {
    "randn": lambda d, dt: torch.randn(2, dtype=dt, device=d),
    "rand": lambda d, dt: torch.rand(2, dtype=dt, device=d),
    "uniform_": lambda d, dt: torch.empty(2, dtype=dt, device=d).uniform_(),
    "normal_": lambda d, dt: torch.empty(2, dtype=dt, device=d).normal_(),
    "normal": lambda d, dt: torch.normal(torch.zeros(2, dtype=dt, device=d), 1.0),
    "exponential_": lambda d, dt: torch.empty(2, dtype=dt, device=d).exponential_(),
    "cauchy_": lambda d, dt: torch.empty(2, dtype=dt, device=d).cauchy_(),
    "log_normal_": lambda d, dt: torch.empty(2, dtype=dt, device=d).log_normal_(),
    "geometric_": lambda d, dt: torch.empty(2, dtype=dt, device=d).geometric_(0.5),
    "bernoulli_": lambda d, dt: torch.empty(2, dtype=dt, device=d).bernoulli_(0.5),
    "random_": lambda d, dt: torch.empty(2, dtype=dt, device=d).random_(),
    "random_(-1, 3)": lambda d, dt: torch.empty(2, dtype=dt, device=d).random_(-1, 3),
    "random_(-300)": lambda d, dt: torch.empty(2, dtype=dt, device=d).random_(-300, None),
    "randint(0, 300)": lambda d, dt: torch.randint(0, 300, (2,), dtype=dt, device=d),
    "randint(0, 2**40)": lambda d, dt: torch.randint(0, 2**40, (2,), dtype=dt, device=d),
    "randint_like(0, 1000)": lambda d, dt: torch.randint_like(torch.zeros(2, dtype=dt, device=d), 0, 1000),
    "randperm(3)": lambda d, dt: torch.randperm(3, dtype=dt, device=d),
    "randperm(200)": lambda d, dt: torch.randperm(200, dtype=dt, device=d),
    "randperm(3000)": lambda d, dt: torch.randperm(3000, dtype=dt, device=d),
    "randperm(-1)": lambda d, dt: torch.randperm(-1, dtype=dt, device=d),
}


def _outcome(fn):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the error is the outcome compared
            return type(e).__name__, str(e), []
    return None, None, sorted({str(w.message).split(" (Triggered")[0] for w in caught})


@pytest.mark.parametrize("name", sorted(_SAMPLERS))
def test_sampling_errors_and_range_checks_match_torch(name):
    # an unsupported dtype raises torch's error type; a range a dtype cannot hold raises instead
    # of wrapping around; a float type too narrow for the integers warns
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16,
                  torch.float32, torch.complex64):
        expected = _outcome(lambda: _SAMPLERS[name]("cpu", dtype))
        assert _outcome(lambda: _SAMPLERS[name]("jax", dtype)) == expected, dtype


@pytest.mark.parametrize("form", ["Tensor_float", "Tensor_Tensor"])
def test_normal_with_a_complex_mean(form):
    mean = torch.full((20000,), 1 + 2j, dtype=torch.complex64, device="jax")
    out = torch.normal(mean, 2.0) if form == "Tensor_float" else torch.normal(mean, torch.full((20000,), 2.0, device="jax"))
    assert out.dtype == torch.complex64
    # torch splits the variance evenly: each part has std 2 / sqrt(2)
    np.testing.assert_allclose([out.real.mean().item(), out.imag.mean().item()], [1, 2], atol=0.05)
    np.testing.assert_allclose([out.real.std().item(), out.imag.std().item()], [math.sqrt(2)] * 2, rtol=0.03)


@pytest.mark.parametrize("std", [-1.0, float("nan")])
def test_normal_rejects_a_negative_or_nan_std_tensor(std):
    for d in ("cpu", "jax"):
        with pytest.raises(RuntimeError, match="normal expects all elements of std >= 0.0"):
            torch.normal(torch.zeros(3, device=d), torch.tensor([1.0, std, 1.0], device=d))


@pytest.mark.slow  # ~15 s; the small-concentration Beta / Dirichlet test below stays in CI
def test_gamma_samples_never_underflow_to_zero():
    # torch clamps to the smallest normal number: a Dirichlet row of zeros would be 0 / 0
    a = torch.full((20000, 2), 0.01, device="jax")
    assert (torch._standard_gamma(a) == 0).sum().item() == 0
    assert not torch._sample_dirichlet(a).isnan().any()
    beta = torch.distributions.Beta(torch.tensor(0.01, device="jax"), torch.tensor(0.01, device="jax"))
    assert not beta.sample((20000,)).isnan().any()


def test_multinomial_with_replacement_needs_memory_of_the_samples_only():
    probs = torch.tensor([0.1, 0.0, 0.5, 0.4, 0.0], device="jax")
    counts = torch.bincount(torch.multinomial(probs, N, True).cpu(), minlength=5).double() / N
    np.testing.assert_allclose(counts.numpy(), [0.1, 0.0, 0.5, 0.4, 0.0], atol=0.01)
    assert counts[1] == 0 and counts[4] == 0
    # 30000 samples of 30000 categories: a (samples, categories) noise tensor would be 3.6 GB
    assert torch.multinomial(torch.ones(30000, device="jax"), 30000, True).shape == (30000,)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_geometric_into_a_narrow_int_wraps_as_torchs_cast(dtype):
    x = host(torch.empty(N, dtype=dtype, device="jax").geometric_(1e-3))
    # values past the type's range wrap around (as a C cast), they do not pile up at its maximum
    assert (x == np.iinfo(np.dtype(str(dtype).split(".")[1])).max).mean() < 0.05


def test_binomial_broadcasts_count_and_prob():
    out = torch.binomial(torch.full((5, 1), 10.0, device="jax"), torch.tensor([0.0, 0.5, 1.0], device="jax"))
    assert out.shape == (5, 3) and out[:, 0].eq(0).all() and out[:, 2].eq(10).all()


# -- explicit generators under t2j.jit ----------------------------------------


def _noisy(x, g):
    return x + torch.randn(x.shape, device=x.device, generator=g), torch.randperm(5, device=x.device, generator=g)


def _same(a, b):
    return all(torch.equal(u.cpu(), v.cpu()) for u, v in zip(a, b))


@pytest.mark.parametrize("device", ["jax", "cpu"])
def test_generator_argument_under_jit_draws_what_eager_draws(device):
    """Each call draws the program's seeds from the generator it is passed, advancing it as
    the eager function's draws do: the same numbers, and a new generator needs no new trace."""
    import torch2jax as t2j

    x = torch.zeros(4, device="jax")
    g = torch.Generator(device=device).manual_seed(3)
    eager = [_noisy(x, g) for _ in range(3)]
    after = g.get_state()
    f = t2j.jit(_noisy)
    g.manual_seed(3)
    jitted = [f(x, g) for _ in range(3)]
    assert all(_same(a, b) for a, b in zip(eager, jitted))
    assert torch.equal(g.get_state(), after)
    assert not _same(jitted[0], jitted[1])
    fresh = torch.Generator(device=device).manual_seed(3)
    assert _same(f(x, fresh), eager[0])
    assert f.stats["traces"] == 1 and f.stats["eager_calls"] == 0


@pytest.mark.parametrize("n", [16, 5000])  # (above 4096 elements a constant result is not folded into the trace)
def test_factories_of_any_size_under_jit_draw_what_eager_draws(n):
    import torch2jax as t2j

    def f(x):
        return (x.sum() + torch.randn(n, device="jax"), torch.randint(0, 9, (n,), device="jax"),
                torch.randperm(n, device="jax"))

    x = torch.zeros(2, device="jax")
    torch.manual_seed(0)
    eager, after = f(x), torch.jax.get_rng_state()
    torch.manual_seed(0)
    assert _same(t2j.jit(f)(x), eager)
    assert torch.equal(torch.jax.get_rng_state(), after)


def test_generators_reached_created_and_reseeded_inside_a_jitted_function():
    """A generator the function reaches through a closure is drawn from on each call; one it
    creates (a sampler's ``torch.Generator(device).manual_seed(0)``) or re-seeds gives the same
    numbers on every call, and is left as the eager function leaves it."""
    import torch2jax as t2j

    outer = torch.Generator(device="jax").manual_seed(1)
    reseeded = torch.Generator(device="jax")

    def sample(x):
        own = torch.Generator(device="jax").manual_seed(0)
        reseeded.manual_seed(7)
        return (x + torch.randn(3, device="jax", generator=outer), torch.rand(3, device="jax", generator=own),
                torch.empty(3, device="jax").normal_(generator=reseeded))

    x = torch.zeros(3, device="jax")
    eager = [sample(x) for _ in range(2)]
    states = outer.get_state(), reseeded.get_state()
    outer.manual_seed(1)
    reseeded.manual_seed(99)
    f = t2j.jit(sample)
    jitted = [f(x) for _ in range(2)]
    assert all(_same(a, b) for a, b in zip(eager, jitted))
    assert torch.equal(outer.get_state(), states[0]) and torch.equal(reseeded.get_state(), states[1])
    assert not torch.equal(jitted[0][0].cpu(), jitted[1][0].cpu())
    assert torch.equal(jitted[0][1].cpu(), jitted[1][1].cpu())


def test_an_explicit_generators_state_saved_and_restored_inside_a_jitted_function():
    # get_state() gave the trace's state and set_state() of it re-seeded with it: every call drew the
    # first call's numbers
    import torch2jax as t2j

    def run(wrap):
        g = torch.Generator(device="jax").manual_seed(0)

        def f(x):
            state = g.get_state()
            first = torch.rand(3, generator=g, device="jax")
            g.set_state(state)
            return first, torch.rand(3, generator=g, device="jax"), torch.rand(3, generator=g, device="jax")

        fn = wrap(f)
        return [[t.tolist() for t in fn(torch.zeros(1, device="jax"))] for _ in range(3)], g.get_state()

    with pytest.warns(UserWarning, match=r"get_state\(\) of a torch.Generator the function draws from"):
        got = run(t2j.jit)
    expected = run(lambda f: f)
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])
    assert got[0][0][0] == got[0][0][1] != got[0][1][0]


def test_generator_noise_under_jit_is_differentiated_with_the_forwards_draws():
    import torch2jax as t2j

    def loss(w, g):
        return (w * torch.randn(w.shape, device="jax", generator=g)).square().sum()

    w = torch.ones(6, device="jax", requires_grad=True)
    loss(w, torch.Generator(device="jax").manual_seed(2)).backward()
    expected, w.grad = w.grad.cpu(), None
    t2j.jit(loss)(w, torch.Generator(device="jax").manual_seed(2)).backward()
    assert torch.equal(w.grad.cpu(), expected)


def test_generator_draws_in_loop_bodies_differ_per_iteration_and_call():
    g = torch.Generator(device="jax").manual_seed(0)

    @torch2jax.jit
    def noise(x):
        _, ys = torch2jax.scan(lambda c, _: (c, torch.randn(64, device="jax", generator=g)), x, None, length=4)
        summed = torch2jax.fori_loop(0, 4, lambda i, c: c + torch.rand(64, device="jax", generator=g), x)
        return ys, summed

    x = torch.zeros(64, device="jax")
    (ys, summed), (ys2, _) = noise(x), noise(x)
    assert len({tuple(row.tolist()) for row in ys.cpu()}) == 4      # one draw per iteration, not one per trace
    assert not torch.equal(ys.cpu(), ys2.cpu())                     # and new ones per call
    assert 1.0 < summed.mean().item() < 3.0                         # four uniform draws summed: mean 2, not 4 * u


def test_lowering_a_jitted_function_leaves_its_generator_alone():
    import torch2jax as t2j

    g = torch.Generator(device="jax").manual_seed(4)
    state = g.get_state()
    f = t2j.jit(_noisy)
    assert "stablehlo" in f.lower(torch.zeros(2, device="jax"), g).as_text()
    assert torch.equal(g.get_state(), state)


def test_generator_under_plain_jax_jit_names_t2j_jit():
    import jax

    import torch2jax as t2j

    def f(x):
        return t2j.call_torch(lambda t: t + torch.randn(t.shape, device="jax", generator=torch.Generator()), x)

    with pytest.raises(RuntimeError, match="use t2j.jit"):
        jax.jit(f)(jax.numpy.zeros(3))


def _cpu_noise(x):
    return x + torch.randn(4).to(x.device), x[torch.randperm(4)]


def test_random_ops_on_the_cpu_inside_jit_draw_on_every_call():
    """torch's CPU draws inside a jitted function (a mixup permutation, noise made on the CPU)
    would be constants of a program: the function runs eagerly instead, drawing what the eager
    function draws and advancing torch's CPU generator as it does."""
    import torch2jax as t2j

    x = torch.arange(4.0, device="jax")
    torch.manual_seed(0)
    eager = [_cpu_noise(x) for _ in range(3)]
    after = torch.rand(2)
    f = t2j.jit(_cpu_noise)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="random op on the CPU"):
        jitted = [f(x) for _ in range(3)]
    assert all(_same(a, b) for a, b in zip(eager, jitted))
    assert torch.equal(torch.rand(2), after)
    with pytest.raises(t2j.OpError, match="random op on the CPU"):
        t2j.jit(_cpu_noise, fullgraph=True)(x)


@pytest.mark.parametrize("reached", ["argument", "closure"])
def test_cpu_generator_drawn_by_a_cpu_op_inside_jit_runs_eagerly(reached):
    import torch2jax as t2j

    g = torch.Generator().manual_seed(5)

    def f(x, gen=None):
        return x + torch.rand(4, generator=gen or g).to(x.device)

    x = torch.zeros(4, device="jax")
    args = (g,) if reached == "argument" else ()
    eager = [f(x, *args) for _ in range(2)]
    g.manual_seed(5)
    jf = t2j.jit(f)
    with pytest.warns(UserWarning, match="random op on the CPU"):
        assert all(_same([a], [jf(x, *args)]) for a in eager)


def test_cpu_draws_after_manual_seed_inside_jit_stay_one_program():
    import torch2jax as t2j

    def f(x):
        torch.manual_seed(3)
        return x + torch.randn(4).to(x.device), torch.randn(2, device=x.device)

    x = torch.zeros(4, device="jax")
    eager, after = f(x), torch.rand(2)
    jf = t2j.jit(f)
    for _ in range(2):
        assert _same(jf(x), eager)
        assert torch.equal(torch.rand(2), after)
    assert jf.stats["eager_calls"] == 0


@pytest.mark.parametrize("draw", [lambda: random.random() < 0.5, lambda: np.random.rand() < 0.5])
def test_python_and_numpy_draws_inside_jit_run_the_function_eagerly(draw):
    """An augmentation branch on Python's or NumPy's generator would be frozen by a trace."""
    import torch2jax as t2j

    def augment(x):
        return x.flip(0) if draw() else x

    x = torch.arange(4.0, device="jax")
    random.seed(0)
    np.random.seed(0)
    eager = [augment(x)[0].item() for _ in range(12)]
    random.seed(0)
    np.random.seed(0)
    f = t2j.jit(augment)
    with pytest.warns(UserWarning, match="numpy.random drew on the host"):
        assert [f(x)[0].item() for _ in range(12)] == eager
    assert len(set(eager)) == 2


@pytest.mark.parametrize("make", [lambda: random.Random(0).random, lambda: np.random.default_rng(0).random,
                                  lambda: np.random.RandomState(0).rand, lambda: _Augment(np.random.default_rng(0))])
def test_generator_objects_of_python_and_numpy_inside_jit_run_the_function_eagerly(make):
    """A generator object the function holds (a bound method, or an attribute of an object it
    reaches) draws on the host too: its numbers would be frozen by a trace."""
    import torch2jax as t2j

    x = torch.arange(4.0, device="jax")
    draw = make()
    eager = [(x.flip(0) if draw() < 0.5 else x)[0].item() for _ in range(12)]
    draw = make()
    f = t2j.jit(lambda x: x.flip(0) if draw() < 0.5 else x)
    with pytest.warns(UserWarning, match="drew on the host"):
        assert [f(x)[0].item() for _ in range(12)] == eager
    assert len(set(eager)) == 2


class _Augment:
    def __init__(self, rng):
        self.rng = rng

    def __call__(self):
        return self.rng.uniform()


def test_manual_seed_inside_jit_with_a_seed_per_step_stays_compiled():
    """``torch.manual_seed(base + step)`` in a step: torch seeds the devices before the CPU
    generator, and the draws after it are the same on every call with that seed."""
    import torch2jax as t2j

    def noisy(x, seed):
        torch.manual_seed(seed)
        return x + torch.randn(3, device=x.device), torch.randint(0, 100, (2,))

    f = t2j.jit(noisy)
    torch.manual_seed(123)
    torch.rand(5)
    x = torch.zeros(3, device="jax")
    for seed in (1, 2, 1):
        got, cpu_draw = f(x, seed)
        after = torch.rand(1)
        expected, expected_cpu = noisy(x, seed)
        assert torch.equal(got, expected) and torch.equal(cpu_draw, expected_cpu)
        assert torch.equal(torch.rand(1), after)  # the CPU stream continues where the call left it
        torch.manual_seed(seed)
        torch.randint(0, 100, (2,))
    assert f.stats["eager_calls"] == 0 and f.stats["compiles"] == 2


def test_small_concentration_beta_and_dirichlet_draws_are_never_exactly_zero_or_one():
    """Their gamma draws underflow: normalized from logarithms, and kept inside (0, 1) as torch's kernel."""
    torch.manual_seed(0)
    beta = torch.distributions.Beta(torch.tensor(2.0, device="jax"), torch.tensor(0.02, device="jax"))
    x = beta.sample((20000,))
    assert (x < 1).all() and beta.log_prob(x).isfinite().all()
    tiny = torch.distributions.Beta(torch.tensor(0.005, device="jax"), torch.tensor(0.005, device="jax"))
    y = tiny.sample((20000,)).cpu().double()
    # P(x < t) for Beta(a, a) near 0, a -> 0: t^a / (a B(a, a)), and a B(a, a) -> 2 (CPU: 0.352)
    assert abs((y < 1e-30).double().mean().item() - 0.5 * 1e-30 ** 0.005) < 0.02
    assert (y == 0.5).double().mean().item() < 0.005
    d = torch.distributions.Dirichlet(torch.full((362,), 0.01, device="jax")).sample((50,))
    assert (d > 0).all() and torch.allclose(d.sum(-1).cpu(), torch.ones(50), atol=1e-5)
    assert torch._sample_dirichlet(torch.tensor(0.5, device="jax")).item() == torch._sample_dirichlet(
        torch.tensor(0.5)).item() == 1 - 2 ** -24


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_poisson_draws_for_large_rates_have_the_rates_variance(dtype):
    torch.manual_seed(0)
    for rate in (1e8, 1e9):
        s = torch.poisson(torch.full((20000,), rate, device="jax", dtype=dtype)).cpu().double()
        assert abs(s.mean().item() / rate - 1) < 4 * (rate ** -0.5) / math.sqrt(20000) + 1e-7
        assert abs(s.var().item() / rate - 1) < 0.06
        if dtype is torch.float64:
            assert abs(((s % 8) == 0).double().mean().item() - 0.125) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_exponential_draws_are_never_zero(dtype):
    """torch's kernel draws no 0 (whose log gumbel_softmax takes): half an epsilon at least."""
    torch.manual_seed(0)
    e = torch.empty(10_000_000, device="jax", dtype=dtype).exponential_()
    assert e.min().item() >= torch.finfo(dtype).eps / 2
    torch.manual_seed(0)
    assert not torch.nn.functional.gumbel_softmax(torch.zeros(1000, 10000, device="jax")).isnan().any()


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_a_restored_state_restores_the_seed(device):
    g = torch.Generator(device=device).manual_seed(5)
    state = g.get_state()
    g.manual_seed(77)
    assert g.set_state(state).initial_seed() == 5
    torch.manual_seed(4)
    with torch.random.fork_rng(device_type="jax"):
        torch.manual_seed(99)
    assert torch.initial_seed() == torch.jax.initial_seed() == 4
    old = torch.jax.get_rng_state()[:-8]  # (a state saved before it held the seed: the seed stays)
    torch.jax.set_rng_state(old)
    assert torch.jax.initial_seed() == 4 and torch.equal(torch.jax.get_rng_state()[:-8], old)


def test_bernoulli_of_a_tiny_probability_is_not_rounded_up():
    # a float32 uniform below p would draw ones with probability 2**-24 at least (torch draws a double)
    torch.manual_seed(0)
    draws = torch.empty(4_000_000, device="jax")
    assert draws.bernoulli_(1e-9).sum().item() == 0
    assert draws.bernoulli_(1.0).sum().item() == draws.numel()
    assert abs(draws.bernoulli_(0.3).mean().item() - 0.3) < 1e-3


@pytest.mark.parametrize("dtype,low,high", [
    (torch.float32, -2e38, 2e38), (torch.float64, -1e308, 1e308), (torch.bfloat16, -2e38, 2e38),
    (torch.float16, 0, 70000), (torch.float16, -70000, 0), (torch.float32, 0, 1e39)])
def test_uniform_bounds_beyond_the_dtype_raise_as_torch(dtype, low, high):
    with pytest.raises(RuntimeError) as expected:
        torch.empty(3, dtype=dtype).uniform_(low, high)
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
        torch.empty(3, dtype=dtype, device="jax").uniform_(low, high)


@pytest.mark.parametrize("call", [
    lambda d: torch._sample_dirichlet(torch.zeros(2, device=d)),
    lambda d: torch.binomial(torch.full((3,), 5.0, device=d), torch.full((3,), 1.5, device=d)),
    lambda d: torch.binomial(torch.full((3,), -5.0, device=d), torch.full((3,), 0.5, device=d)),
    lambda d: torch._standard_gamma(torch.tensor([-1.0, 0.0], device=d)),
], ids=["dirichlet of zeros", "binomial with p > 1", "binomial of a negative count", "gamma of alpha <= 0"])
def test_samplers_of_degenerate_parameters_give_torchs_values(call):
    torch.testing.assert_close(call("jax").cpu(), call("cpu"))


def test_the_device_modules_seeding_api_is_torch_cudas():
    torch.manual_seed(0)
    cpu_draw = torch.rand(1)
    torch.manual_seed(0)
    torch.jax.seed()  # (the jax device's generator only, as torch.cuda.seed)
    torch.jax.seed_all()
    assert torch.equal(torch.rand(1), cpu_draw)
    first = torch.rand(3, device="jax")
    torch.jax.seed()
    assert not torch.equal(torch.rand(3, device="jax"), first)
    states = torch.jax.get_rng_state_all()
    drawn = torch.rand(3, device="jax")
    torch.jax.set_rng_state_all(states)
    assert len(states) == 1 and torch.equal(torch.rand(3, device="jax"), drawn)


def test_multinomial_draws_a_tiny_weight_as_rarely_as_torch():
    # torch's CPU kernel draws double uniforms: float32 ones are 0 once in 2^23 draws and picked the first
    # category whatever its weight (about 4 of these 2^25 draws; torch: none, as expected for 1e-12)
    probs = torch.tensor([1e-12, 1.0], device="jax")
    assert sum(int((torch.multinomial(probs, 2**23, replacement=True) == 0).sum()) for _ in range(4)) == 0
