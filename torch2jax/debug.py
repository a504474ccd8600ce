"""Seeing what torch2jax does: counters, op reports, op and recompile logs, the JAX profiler.

Example::

    import torch2jax as t2j

    t2j.debug.reset_counters()
    with t2j.debug.op_report() as report:
        loss = step(x, y)
    print(report)                     # the ops that decomposed or ran on the host
    print(t2j.debug.counters())       # {'traces': 1, 'compiles': 1, 'cache_hits': 0, ...}

    t2j.debug.set_log("ops,recompiles")   # or TORCH2JAX_LOG=ops,recompiles in the environment

    with t2j.debug.profile("/tmp/trace"):     # open in TensorBoard / Perfetto / XProf
        with t2j.debug.annotate("forward"):
            loss = model(x).sum()
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import warnings

import jax

from . import dispatch as _dispatch

# -- counters ------------------------------------------------------------------


def counters() -> dict:
    """How often each event happened since the last `reset_counters`.

    ``traces`` / ``compiles`` / ``cache_hits``: of `t2j.jit` and `t2j.compile`;
    ``host_fallbacks``: ops run by torch on the host; ``decompositions``: ops run
    through a decomposition (torch's table or the op's composite kernel). Under
    `t2j.jit` ops are dispatched while tracing only, so a cached call adds nothing
    to the op counts.

    >>> t2j.debug.reset_counters(); step(x, y); step(x, y)
    >>> t2j.debug.counters()["cache_hits"]
    1
    """
    return dict(_dispatch.COUNTERS)


def reset_counters() -> None:
    """Set every counter of `counters` back to zero.

    >>> t2j.debug.reset_counters()
    """
    for name in _dispatch.COUNTERS:
        _dispatch.COUNTERS[name] = 0


def count(event: str, n: int = 1) -> None:
    """Add ``n`` to counter ``event`` (one of the keys of `counters`); t2j.jit calls it.

    >>> t2j.debug.count("traces")
    """
    if event not in _dispatch.COUNTERS:
        raise ValueError(f"t2j.debug.count: unknown event {event!r}; expected one of {sorted(_dispatch.COUNTERS)}")
    _dispatch.COUNTERS[event] += n


# -- op report -----------------------------------------------------------------


class OpReport:
    """The ops dispatched to the jax device during an `op_report` block: for each
    op (its name, e.g. ``"aten.addmm.default"``) the path it took and how often it ran.
    Filled when the block ends."""

    def __init__(self):
        self.calls: dict = {}
        self.paths: dict = {}

    def _fill(self, log):
        for op in log:
            name = str(op)
            self.calls[name] = self.calls.get(name, 0) + 1
            self.paths[name] = _dispatch.path_of(op)

    def _on(self, path):
        return {op: n for op, n in self.calls.items() if self.paths[op] == path}

    @property
    def decomposed(self) -> dict:
        """``{op: calls}`` of the ops that ran through a decomposition."""
        return self._on("decomposition")

    @property
    def fallbacks(self) -> dict:
        """``{op: calls}`` of the ops that ran on the host through torch."""
        return self._on("fallback")

    def __str__(self):
        by_path: dict = {}
        for op, path in self.paths.items():
            by_path[path] = by_path.get(path, 0) + 1
        summary = ", ".join(f"{n} {path}" for path, n in sorted(by_path.items()))
        lines = [f"torch2jax op report: {len(self.calls)} ops, {sum(self.calls.values())} calls ({summary or 'none'})"]
        for title, ops in (("host fallback", self.fallbacks), ("decomposition", self.decomposed)):
            for op, n in sorted(ops.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {title:13}  {op}  x{n}")
        return "\n".join(lines)

    __repr__ = __str__


@contextlib.contextmanager
def op_report():
    """Report the ops that decomposed or fell back to the host inside the block.

    >>> with t2j.debug.op_report() as r:
    ...     model(x)
    >>> print(r)
    torch2jax op report: 14 ops, 31 calls (1 decomposition, 13 lowering)
      decomposition  aten.dist.default  x1
    >>> r.fallbacks
    {}
    """
    report = OpReport()
    with _dispatch.record_ops() as log:
        try:
            yield report
        finally:
            report._fill(log)


# -- logs ----------------------------------------------------------------------

_LOGGERS = {"ops": "torch2jax.ops", "recompiles": "torch2jax.jit"}
_handler: logging.Handler | None = None


def set_log(what: str | None) -> None:
    """Log what torch2jax does, through the `logging` module, at INFO level:

    - ``"ops"``: every op dispatched to the jax device, with the path it took
      (lowering, functional, decomposition, fallback) and its inputs' dtypes and
      shapes (logger ``torch2jax.ops``); the ops a decomposition runs are indented
      under it;
    - ``"recompiles"``: why a `t2j.jit` function is traced again (logger ``torch2jax.jit``).

    Several are separated by commas; ``None`` or ``""`` turns them off. When logging
    is not configured, the lines go to stderr. The environment variable
    ``TORCH2JAX_LOG`` sets the same at import.

    >>> t2j.debug.set_log("ops")
    >>> torch.ones(2, device="jax") + 1
    torch2jax.ops: aten.add.Tensor [lowering] (f32[2], 1)
    """
    kinds = _parse(what)
    _dispatch.log_ops = "ops" in kinds
    for kind, name in _LOGGERS.items():
        logging.getLogger(name).setLevel(logging.INFO if kind in kinds else logging.NOTSET)
    if kinds:
        _ensure_handler()


def _parse(what):
    if what is None:
        return set()
    if not isinstance(what, str):
        raise TypeError(f"t2j.debug.set_log: expected a string such as 'ops,recompiles' or None, got {what!r}")
    kinds = {k.strip() for k in what.split(",") if k.strip()}
    unknown = kinds - set(_LOGGERS)
    if unknown:
        raise ValueError(f"t2j.debug.set_log: unknown log {sorted(unknown)}; expected some of {sorted(_LOGGERS)}")
    return kinds


def _ensure_handler():
    """Send torch2jax's log lines to stderr unless the program configured logging itself."""
    global _handler
    if _handler is not None or logging.getLogger().handlers:
        return
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.getLogger("torch2jax").addHandler(_handler)


def set_log_from_environment() -> None:
    """Apply ``TORCH2JAX_LOG`` (torch2jax does this at import); a bad value warns."""
    try:
        set_log(os.environ.get("TORCH2JAX_LOG"))
    except ValueError as e:
        warnings.warn(f"TORCH2JAX_LOG: {e}", stacklevel=2)


# -- profiler ------------------------------------------------------------------


@contextlib.contextmanager
def profile(logdir: str, *, perfetto: bool = False):
    """Record a JAX profiler trace of the block into ``logdir`` (TensorBoard's profile
    plugin or XProf read it; ``perfetto=True`` also writes a Perfetto trace). Work
    still running on the device when the block ends is waited for, so it is in the trace.

    >>> with t2j.debug.profile("/tmp/t2j-trace"):
    ...     step(x, y)
    """
    if not isinstance(logdir, (str, os.PathLike)):
        raise TypeError(f"t2j.debug.profile: expected a directory path for logdir, got {logdir!r}")
    with jax.profiler.trace(os.fspath(logdir), create_perfetto_trace=perfetto):
        yield
        jax.block_until_ready(jax.live_arrays())


class annotate:
    """Name a region of torch code in profiles and in the compiled program.

    A context manager or a decorator. The name marks the region in a `profile`
    trace (a `jax.profiler.TraceAnnotation`) and is put on the name stack of the
    JAX operations it runs (`jax.named_scope`), so under `t2j.jit` it shows in the
    HLO op metadata (``op_name="jit(step)/attention/..."``) and in the device
    rows of the trace.

    >>> with t2j.debug.annotate("attention"):
    ...     y = attn(x)
    >>> @t2j.debug.annotate("loss")
    ... def loss_fn(logits, labels): ...
    """

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise TypeError(f"t2j.debug.annotate: expected a non-empty string name, got {name!r}")
        self.name = name
        self._open: list = []

    def __enter__(self):
        stack = contextlib.ExitStack()
        stack.enter_context(jax.profiler.TraceAnnotation(self.name))
        stack.enter_context(jax.named_scope(self.name))
        self._open.append(stack)
        return self

    def __exit__(self, *exc):
        return self._open.pop().__exit__(*exc)

    def __call__(self, fn):
        @functools.wraps(fn)
        def annotated(*args, **kwargs):
            with annotate(self.name):
                return fn(*args, **kwargs)

        return annotated


__all__ = [
    "OpReport",
    "annotate",
    "count",
    "counters",
    "op_report",
    "profile",
    "reset_counters",
    "set_log",
    "set_log_from_environment",
]
