"""t2j.debug: counters, op reports, op and recompile logs, the JAX profiler and annotations."""

from __future__ import annotations

import gzip
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

import torch2jax as t2j

_lib = torch.library.Library("t2jdebug", "DEF")
_lib.define("host_only(Tensor x) -> Tensor")
_lib.impl("host_only", lambda x: x + 1, "CPU")
_lib.impl("host_only", lambda x: torch.empty_like(x), "Meta")


def _host_only(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ops.t2jdebug.host_only(x)


@pytest.fixture(autouse=True)
def _logs_off():
    yield
    t2j.debug.set_log(None)


# -- counters ------------------------------------------------------------------


def test_counters_count_host_fallbacks_and_decompositions():
    x = torch.ones(2, 3, device="jax")
    t2j.debug.reset_counters()
    assert t2j.debug.counters() == dict.fromkeys(
        ["traces", "compiles", "cache_hits", "host_fallbacks", "decompositions"], 0
    )
    out = _host_only(x)
    torch.dist(x, out)
    torch.dist(x, out)
    c = t2j.debug.counters()
    assert c["host_fallbacks"] == 1
    assert c["decompositions"] == 2  # aten.dist.default, twice
    t2j.debug.reset_counters()
    assert set(t2j.debug.counters().values()) == {0}


def test_count_refuses_unknown_events():
    t2j.debug.reset_counters()
    t2j.debug.count("traces", 2)
    assert t2j.debug.counters()["traces"] == 2
    with pytest.raises(ValueError, match=r"t2j.debug.count: unknown event 'trace'.*'traces'"):
        t2j.debug.count("trace")


def test_counters_count_jit_traces_compiles_and_cache_hits():
    model = torch.nn.Linear(3, 2).to("jax")

    @t2j.jit
    def f(x):
        return model(x).sum()

    t2j.debug.reset_counters()
    f(torch.ones(4, 3))
    f(torch.ones(4, 3))
    f(torch.ones(5, 3))
    c = t2j.debug.counters()
    assert (c["traces"], c["compiles"], c["cache_hits"]) == (2, 2, 1)


# -- op report -----------------------------------------------------------------


def test_op_report_lists_decompositions_and_host_fallbacks():
    x = torch.ones(2, 3, device="jax")
    with t2j.debug.op_report() as r:
        y = _host_only(x)
        torch.dist(x, y)
        torch.dist(x, y)
        torch.relu(y)
    assert r.fallbacks == {"t2jdebug.host_only.default": 1}
    assert r.decomposed == {"aten.dist.default": 2}
    assert r.paths["aten.relu.default"] == "lowering"
    text = str(r)
    assert "host fallback  t2jdebug.host_only.default  x1" in text
    assert "decomposition  aten.dist.default  x2" in text
    assert "aten.relu.default" not in text


def test_op_reports_nest():
    x = torch.ones(3, device="jax")
    with t2j.debug.op_report() as outer:
        x + 1
        with t2j.debug.op_report() as inner:
            torch.dist(x, x)
    assert "aten.dist.default" in inner.decomposed and "aten.add.Tensor" not in inner.calls
    assert "aten.dist.default" in outer.decomposed and "aten.add.Tensor" in outer.calls


# -- logs ----------------------------------------------------------------------


def test_ops_log_names_op_path_and_inputs(caplog):
    x = torch.ones(2, 3, device="jax")
    idx = torch.tensor([1, 0])
    with caplog.at_level(logging.INFO, logger="torch2jax.ops"):
        t2j.debug.set_log("ops")
        torch.dist(x, x.to(torch.bfloat16))
        x[idx]
        t2j.debug.set_log(None)
        x * 2
    lines = [r.getMessage() for r in caplog.records if r.name == "torch2jax.ops"]
    assert "aten._to_copy.default [lowering] (f32[2,3], dtype=torch.bfloat16)" in lines
    assert "aten.dist.default [decomposition] (f32[2,3], bf16[2,3])" in lines
    assert any(line.startswith("  aten.sub.Tensor [lowering]") for line in lines)  # inside dist
    assert "aten.index.Tensor [lowering] (f32[2,3], [i64[2]@cpu])" in lines
    assert not any("aten.mul.Tensor" in line for line in lines)


def test_set_log_refuses_bad_values():
    with pytest.raises(ValueError, match=r"set_log: unknown log \['op'\].*'ops', 'recompiles'"):
        t2j.debug.set_log("op")
    with pytest.raises(TypeError, match="set_log: expected a string"):
        t2j.debug.set_log(True)


def test_recompiles_log_gives_the_reason(caplog):
    model = torch.nn.Linear(3, 2).to("jax")

    @t2j.jit
    def f(x):
        return model(x).sum()

    f(torch.ones(4, 3))
    with caplog.at_level(logging.INFO, logger="torch2jax.jit"):
        t2j.debug.set_log("recompiles")
        f(torch.ones(5, 3))
    lines = [r.getMessage() for r in caplog.records if r.name == "torch2jax.jit"]
    assert any("retracing" in line and "[4, 3] -> torch.float32 [5, 3]" in line for line in lines), lines


def test_environment_variable_turns_logs_on_at_import():
    code = (
        "import torch, torch2jax as t2j\n"
        "f = t2j.jit(lambda x: x * 2)\n"
        "f(torch.ones(2)); f(torch.ones(3))\n"
    )
    env = {**os.environ, "TORCH2JAX_LOG": "ops,recompiles", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "torch2jax.ops: aten.mul.Tensor [lowering] (f32[2], 2)" in proc.stderr
    assert "torch2jax.jit: t2j.jit: retracing" in proc.stderr


# -- profiler ------------------------------------------------------------------


def test_profile_writes_a_trace_with_annotations(tmp_path):
    x = torch.randn(64, 64, device="jax")
    with t2j.debug.profile(tmp_path, perfetto=True):
        with t2j.debug.annotate("t2j_matmul_region"):
            (x @ x).sum().item()
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert any(f.endswith(".xplane.pb") for f in files), files
    perfetto = [f for f in files if f.endswith("perfetto_trace.json.gz")]
    assert perfetto, files
    with gzip.open(perfetto[0], "rt") as fh:
        assert "t2j_matmul_region" in fh.read()


def test_profile_refuses_a_bad_logdir():
    with pytest.raises(TypeError, match="t2j.debug.profile: expected a directory path"):
        with t2j.debug.profile(None):
            pass


def test_annotate_names_hlo_ops_under_jit():
    model = torch.nn.Linear(3, 2).to("jax")

    @t2j.debug.annotate("t2j_loss")
    def loss(y):
        return (y * y).mean()

    @t2j.jit
    def f(x):
        with t2j.debug.annotate("t2j_forward"):
            y = model(x)
        return loss(y)

    x = torch.ones(4, 3)
    torch.testing.assert_close(f(x).cpu(), (model(x.to("jax")) ** 2).mean().cpu())
    hlo = f.lower(x).compile().as_text()
    names = [line for line in hlo.splitlines() if 'op_name="' in line]
    assert any("/t2j_forward/" in line and "dot" in line for line in names), hlo
    assert any("/t2j_loss/" in line for line in names), hlo


def test_annotate_refuses_a_bad_name():
    with pytest.raises(TypeError, match="t2j.debug.annotate: expected a non-empty string"):
        t2j.debug.annotate(3)
