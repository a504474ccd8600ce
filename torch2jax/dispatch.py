"""How an ATen op on the "jax" device is run (DESIGN.md, decision 3).

Resolution order, decided once per `OpOverload` and cached:

1. view ops: the registered view lowering, else torch's composite, else a
   generic strided view computed from torch's own meta kernel;
2. a direct lowering from `torch2jax.ops` (`registry.LOWERINGS`);
3. mutating ops (in-place ``foo_`` and ``out=``): the functional variant, whose
   results are written back into the mutated tensors;
4. torch's decomposition table (`torch._decomp.decomposition_table`), then the
   op's own CompositeImplicitAutograd kernel;
5. the host fallback: the torch op runs on CPU (through `jax.pure_callback`
   when traced), with a one-time warning;
6. an error that names the op.

`coverage` reports which of these paths each op took.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import types
import warnings

import jax
import jax.extend.core
import numpy as np
import torch
import torch.utils._pytree as _pytree
from jax._src import config as _jax_config
from jax._src import core as _jax_core
from jax._src.array import ArrayImpl as _ArrayImpl
from torch import _prims_common

from . import complex32 as _complex32
from . import device as _device
from . import dtypes as _dt
from . import env as _env
from . import gradcut as _gradcut
from . import symbolic as _sym
from . import tensor as _tensor
from .ops import registry as _reg
from .tensor import DEVICE, Tensor, ViewStep, from_torch_cpu, jax_array, new_tensor, torch_cpu

aten = torch.ops.aten


class OpError(RuntimeError):
    """An op could not run on the jax device; the message names the op and why."""


class ValueNeeded(OpError):
    """Python asked for the value of a tensor or number being traced (``.tolist()``, ``int(t.item())``,
    ``.cpu()``): it is known only when the program runs."""


class ExportError(OpError, BufferError):
    """A tensor traced inside jit exported through DLPack (a BufferError, as torch's refusals to
    export are): its value exists only when the program runs. Under `t2j.jit` a graph break."""


class HostFallback(Exception):
    """Raised by a lowering for inputs it does not cover (a dtype torch computes with a
    kernel of its own): the op then runs through the host fallback, as an op with no
    lowering does."""


class TorchRuntimeError(RuntimeError):
    """The RuntimeError torch itself raises for this input, with torch's message."""


class TorchValueError(ValueError):
    """The ValueError torch itself raises for this input (its ``TORCH_CHECK_VALUE``), with torch's message."""


class TorchTypeError(TypeError):
    """The TypeError torch itself raises for this input (its ``TORCH_CHECK_TYPE``), with torch's message."""


class DeviceMismatchError(OpError):
    """An op got a CPU tensor of one or more dimensions beside tensors on the jax device.

    torch refuses to mix devices in one op (except 0-dim CPU tensors, which act as
    scalars); mixing here would also break autograd, whose engine cannot route a
    gradient from the jax device back to the CPU tensor. The message names the op
    the user called (the outermost one when the mix is found inside a decomposition).
    """

    def __init__(self, tensor):
        super().__init__()
        self.shape, self.dtype = list(tensor.shape), tensor.dtype
        self.ops: list = []

    def __str__(self):
        op = self.ops[-1] if self.ops else "an op"
        return (
            f"torch2jax: {op}: Expected all tensors to be on the same device, but found at least two devices, "
            f"{DEVICE} and cpu! A CPU tensor of shape {self.shape} ({self.dtype}) was passed with tensors on "
            f"the jax device; only 0-dim CPU tensors mix with them (as with CUDA). Move it with .to('jax')."
        )


_HANDLERS: dict = {}
# id(op) -> (op, handler, handler that leaves results in any layout): `dispatch` looks the
# handler up by identity, since an OpOverload hashes in Python; the entry holds the op, so its
# id is not reused.
_BY_ID: dict = {}
_PATHS: dict = {}
_coverage_log: list | None = None
_warned: set = set()

_X64 = _jax_config.enable_x64

# Events counted for `t2j.debug.counters` (t2j.jit adds its traces, compiles and cache hits).
COUNTERS = dict.fromkeys(("traces", "compiles", "cache_hits", "host_fallbacks", "decompositions"), 0)

# Set by `t2j.debug.set_log("ops")`: every dispatched op is logged (one boolean check when off).
log_ops = False
_ops_logger = logging.getLogger("torch2jax.ops")
_log_depth = 0


def dispatch(func, args, kwargs, laid_out=True):
    """Run ATen op ``func`` on torch2jax tensors and return torch2jax tensors; with ``laid_out``
    False, results may have other strides than torch's (a caller that reads only their values)."""
    if _tensor.TRACING is not None and _tensor.TRACING != _get_ident():
        with _tensor.TRACE_LOCK:  # (another thread is tracing: run once it is done, `traced_block`)
            return dispatch(func, args, kwargs, laid_out)
    entry = _BY_ID.get(id(func))
    if entry is None or entry[0] is not func:
        _resolve(func)
        entry = _BY_ID[id(func)]
    handler = entry[1] if laid_out else entry[2]
    if _coverage_log is not None:
        _coverage_log.append(func)
    if log_ops:
        return _run_logged(handler, func, args, kwargs)
    # 64-bit types on for the op (torch's int64 and float64), switched through the
    # thread-local setting itself: the `jax.enable_x64` context manager costs more
    # than the rest of this function.
    previous = _X64.swap_local(True)
    try:
        out = _run(handler, func, args, kwargs)
    finally:
        _X64.set_local(previous)
    if not _grad_enabled() and _gradcut.cutting():
        _cut(out, args, kwargs)
    return out


def _run_logged(handler, func, args, kwargs):
    """`dispatch` with a log line per op; the ops a decomposition runs are indented under it."""
    global _log_depth
    _ops_logger.info("%s%s [%s] %s", "  " * _log_depth, func, _PATHS[func], _brief(args, kwargs))
    _log_depth += 1
    try:
        with jax.enable_x64(True):
            out = _run(handler, func, args, kwargs)
    finally:
        _log_depth -= 1
    if _gradcut.cutting():
        _cut(out, args, kwargs)
    return out


def _cut(out, args, kwargs):
    """Cut the results of an op that autograd does not record (torch2jax/gradcut.py): a
    new tensor's value stops the gradient, a view of an operand reads through
    ``DETACHED``. Operands returned as results (in-place ops, ``out=``) are left alone:
    their writes were cut as they were made."""
    operands = [a for a in _pytree.tree_leaves((args, kwargs)) if isinstance(a, Tensor)]
    ids = {id(a) for a in operands}
    storages = {id(a._t2j_storage) for a in operands}
    for t in _pytree.tree_leaves(out):
        if not isinstance(t, Tensor) or id(t) in ids:
            continue
        if t._t2j_view or id(t._t2j_storage) in storages:
            if _tensor.DETACHED not in t._t2j_view:
                t._t2j_view += (_tensor.DETACHED,)
                t._t2j_version = -1  # read again through the new chain
        else:
            t._t2j_storage.array = _gradcut.stop(t._t2j_storage.array)



def _brief(args, kwargs):
    """Inputs in JAX's short notation: ``(f32[4,8], i64[4]@cpu, 1)``."""

    def one(a):
        if isinstance(a, torch.Tensor):
            where = "" if isinstance(a, Tensor) else f"@{a.device}"
            return f"{_short_dtype(a.dtype)}[{','.join(map(str, a.shape))}]{where}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(one(b) for b in a) + "]"
        return _repr(a)

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


@functools.lru_cache(maxsize=None)
def _short_dtype(dtype):
    name = str(dtype).removeprefix("torch.")
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i"), ("complex", "c")):
        if name.startswith(long):
            return short + name[len(long):]
    return name


def _run(handler, func, args, kwargs):
    try:
        return handler(func, args, kwargs)
    except SparseOperand:
        return sparse_run(func, args, kwargs)
    except _dt.Complex32Needed:
        if not _complex32.involved((args, kwargs)):
            raise
        return _complex32.run(func, args, kwargs)
    except DeviceMismatchError as e:
        e.ops.append(func)
        raise
    except (OpError, TorchRuntimeError, TorchValueError, TorchTypeError, IndexError, NotImplementedError,
            jax.errors.ConcretizationTypeError):
        raise
    except RuntimeError as e:
        # exactly RuntimeError: a lowering's check in torch's words, or torch's own CPU kernel
        # (JAX's failures are subclasses of it, or other types)
        _refuse_deleted_input(func, e)
        if type(e) is RuntimeError:
            raise
        _reraise_with_torch_message(func, args, kwargs, e)
        raise
    except Exception as e:
        _refuse_deleted_input(func, e)
        _reraise_with_torch_message(func, args, kwargs, e)
        raise


def _refuse_deleted_input(func, error):
    """A clear error where an op's input holds a deleted jax.Array (JAX says so as a RuntimeError
    or, from a compiled op, a ValueError)."""
    if "has been deleted" in str(error) or "deleted or donated" in str(error):
        raise OpError(
            f"torch2jax: {func}: an input's jax.Array was deleted, most likely donated to a JAX program "
            "(jax.jit(..., donate_argnums=...) of t2j.functionalize's state, which shares the module's "
            "arrays). Put the state the program returned back into the module with fn.write_back(state), "
            "or do not donate it") from error


def _reraise_with_torch_message(func, args, kwargs, error):
    """Replace an error from deep inside JAX by torch's own message for the same input.

    torch's meta kernels check shapes, dtypes and arguments exactly as eager
    torch does; if they reject the input, that is the error the user gets.
    """
    if isinstance(error, RuntimeError) and "torch2jax" in str(error):
        return
    if isinstance(error, jax.errors.UnexpectedTracerError):
        raise OpError(
            f"torch2jax: {func}: an input holds a placeholder of a t2j.jit or jax.jit trace, kept outside it by a "
            "hook, a list append or an attribute set while the function was traced. t2j.jit gives such a tensor "
            "its value when the trace completes and runs; a trace that stopped (the function then ran eagerly, its "
            "side effects twice) and jax.jit leave it without one. Return the tensor from the jitted function "
            "instead, or keep the one the eager run made"
        ) from None
    if isinstance(func, torch._ops.OpOverload) and torch.Tag.pointwise in func.tags:
        shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        message = _reg.broadcast_error(shapes)
        if message:
            raise TorchRuntimeError(message) from None
    try:
        margs, mkwargs = _tree_map_tensors(_to_meta, (args, kwargs))
        if "device" in mkwargs:
            mkwargs["device"] = torch.device("meta")
        func(*margs, **mkwargs)
    except Exception as torch_error:  # noqa: BLE001 - torch's own verdict on the input
        if type(torch_error) is not NotImplementedError and "meta" not in str(torch_error).lower():
            raise torch_error from None
    _raise_cpu_dtype_error(func, args, kwargs)  # (JAX refuses a dtype with a TypeError, or fails later)
    raise OpError(
        f"torch2jax: {func} failed on inputs {_describe(args, kwargs)}: {type(error).__name__}: {error}"
    ) from error


_DTYPE_WORDS = ("not implemented for", "not supported for", "dtype", "Bool", "Float", "Half", "Long", "Int",
                "Complex", "Double", "Byte", "Char", "Short", "complex", "unsigned")


def _raise_cpu_dtype_error(func, args, kwargs):
    """torch's CPU kernel's error where it rejects the operands' dtypes and its meta kernel does not
    (``floor`` of a complex tensor, ``&`` of floats: NotImplementedError), found by running it on
    one-element stand-ins of the same dtypes and ranks. An error that does not speak of dtypes is
    the stand-ins' own, and is not raised."""
    if isinstance(func, torch._ops.OpOverload) and func.namespace == "aten":
        _raise_stand_ins_dtype_error(func, args, kwargs, _DTYPE_WORDS, full_shapes=False)


def raise_cpu_dtype_error(func, args, kwargs):
    """`_raise_cpu_dtype_error` on stand-ins of the operands' full shapes (a kernel may check its
    other arguments, ``topk``'s k, before the dtype), for `registry.refused_dtypes`."""
    _raise_stand_ins_dtype_error(func, args, kwargs, _DTYPE_WORDS, full_shapes=True)


# what torch's errors are raised as, by their type
_TORCH_ERRORS = {RuntimeError: TorchRuntimeError, TypeError: TorchTypeError, NotImplementedError: NotImplementedError}


def _raise_stand_ins_dtype_error(func, args, kwargs, words, full_shapes):
    """Run ``func`` on the CPU on zero-filled stand-ins of the tensors in ``args`` and
    ``kwargs`` (of their dtypes, and of their shapes where ``full_shapes``, else of one
    element and their ranks), and raise its error if that speaks of dtypes (has one of
    ``words``)."""
    tensors = [a for a in _pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if not tensors:
        return

    def stand_in(t):
        return torch.zeros(tuple(t.shape) if full_shapes else (1,) * t.dim(), dtype=t.dtype)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an out= resized from a stand-in's shape
            func(*_tree_map_tensors(stand_in, args), **_tree_map_tensors(stand_in, kwargs))
    except (NotImplementedError, RuntimeError, TypeError) as torch_error:
        if type(torch_error) in _TORCH_ERRORS and any(w in str(torch_error) for w in words):
            raise _TORCH_ERRORS[type(torch_error)](str(torch_error)) from None
    except Exception:  # noqa: BLE001 - the stand-ins' own failure says nothing of the input
        pass


def _repr(a):
    """``repr(a)`` for an error or log line; a storage's repr would read every element."""
    if isinstance(a, (torch.UntypedStorage, torch.TypedStorage)):
        return f"{type(a).__name__}(nbytes={a.nbytes()}, device={a.device})"
    return repr(a)


def _describe(args, kwargs):
    def one(a):
        if isinstance(a, torch.Tensor):
            return f"Tensor({list(a.shape)}, {a.dtype}, {a.device})"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(one(b) for b in a) + "]"
        return _repr(a)

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


# ---------------------------------------------------------------------------
# unwrapping and wrapping
# ---------------------------------------------------------------------------


def _unwrap(a, cpu_ok=False):
    if isinstance(a, Tensor):
        if _tensor.CAPTURE is not None:
            _tensor.CAPTURE.read(a)
        return a._value()
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            return _foreign(a)
        if a.dim() and not cpu_ok:
            raise DeviceMismatchError(a)
        return jax_array(a)
    if isinstance(a, (list, tuple)):
        if any(isinstance(b, (torch.Tensor, list, tuple, _SYM)) for b in a):
            return type(a)(_unwrap(b, cpu_ok) for b in a)
        return a
    if isinstance(a, _SYM) and _sym.is_traced_number(a):
        return _sym.scalar_value_of(a)
    return a


_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


class SparseOperand(Exception):
    """Raised where an op meets a sparse jax tensor among its operands: `_run` hands the op to
    torch2jax/ops/sparse.py (``sparse_run``)."""


sparse_run = None  # torch2jax.ops.sparse.run, set when it is imported


def is_sparse_jax(x) -> bool:
    """Whether ``x`` is a tensor of a sparse layout on the jax device (torch's own, its parts jax tensors)."""
    return isinstance(x, torch.Tensor) and x.layout != torch.strided and x.device.type == DEVICE.type


def _foreign(a):
    if is_sparse_jax(a):
        raise SparseOperand
    raise OpError(f"torch2jax: expected a tensor on the jax or cpu device, got one on {a.device}")


# Arguments that torch lets stay on the CPU beside tensors on an accelerator: index
# tensors, tensor_split's split points, a packed sequence's lengths and batch sizes,
# CTC's sequence lengths, and both sides of a copy across devices ("*": every argument).
_CPU_ARGUMENTS = {
    "copy": "*",
    "copy_": "*",
    "_copy_from": "*",
    "_copy_from_and_resize": "*",
    "_to_copy": "*",
    "index": {"indices"},
    "index_put": {"indices"},
    "index_put_": {"indices"},
    "_index_put_impl_": {"indices"},
    "_unsafe_index": {"indices"},
    "_unsafe_index_put": {"indices"},
    "tensor_split": {"tensor_indices_or_sections"},
    "_pack_padded_sequence": {"lengths"},
    "_pack_padded_sequence_backward": {"batch_sizes"},
    "_pad_packed_sequence": {"batch_sizes"},
    "lstm": {"batch_sizes"},
    "gru": {"batch_sizes"},
    "rnn_tanh": {"batch_sizes"},
    "rnn_relu": {"batch_sizes"},
    # CUDA's ctc_loss reads the lengths on the host; CTC training code keeps them there
    "ctc_loss": {"input_lengths", "target_lengths"},
    "_ctc_loss": {"input_lengths", "target_lengths"},
    "_ctc_loss_backward": {"input_lengths", "target_lengths"},
}


def _cpu_arguments(func):
    """(positions, names) of the arguments of ``func`` that may be CPU tensors, or None."""
    if not isinstance(func, torch._ops.OpOverload):
        return None
    names = _CPU_ARGUMENTS.get(func._schema.name.split("::")[1])
    if names is None:
        return None
    arguments = func._schema.arguments
    if names == "*":
        names = {a.name for a in arguments}
    return {i for i, a in enumerate(arguments) if a.name in names}, names


def _unwrap_call(cpu_args, args, kwargs):
    """``args`` and ``kwargs`` as arrays, CPU tensors allowed in the ``cpu_args`` of `_cpu_arguments`."""
    positions, names = cpu_args
    return (
        [_unwrap(a, i in positions) for i, a in enumerate(args)],
        {k: _unwrap(v, k in names) for k, v in kwargs.items()},
    )


def _check_devices(func, args, kwargs):
    """Raise `DeviceMismatchError` for a CPU tensor that torch would not mix with the jax device."""
    cpu_args = _cpu_arguments(func)
    positions, names = cpu_args if cpu_args is not None else ((), ())

    def check(a, ok):
        if isinstance(a, torch.Tensor) and not isinstance(a, Tensor) and a.device.type == "cpu" and a.dim() and not ok:
            raise DeviceMismatchError(a)
        if isinstance(a, (list, tuple)):
            for b in a:
                check(b, ok)

    for i, a in enumerate(args):
        check(a, i in positions)
    for k, v in kwargs.items():
        check(v, k in names)


def _wrap(out):
    if type(out) is _ArrayImpl or isinstance(out, (jax.Array, jax.core.Tracer)):
        return new_tensor(out)
    if isinstance(out, np.ndarray):
        return new_tensor(jax.numpy.asarray(out))
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o) for o in out)
    return out


def _unshared(out, operands):
    """``out``, or a copy of it where it is one of ``operands``' arrays (an identity
    lowering, or a jitted one whose output JAX forwards from its input). A result
    is a new storage, and two storages must never hold one buffer: `t2j.jit`
    donates the buffers of the state it overwrites, which would delete the other."""
    for a in operands:
        if a is out:
            return out.copy()
    return out


def _unshared_all(out, operands):
    if isinstance(out, (list, tuple)):
        return type(out)(_unshared(o, operands) if type(o) is _ArrayImpl else o for o in out)
    return out


def _array_of(out):
    if isinstance(out, Tensor):
        return out._value()
    if isinstance(out, torch.Tensor):
        return jax_array(out)
    if isinstance(out, (list, tuple)):
        return type(out)(_array_of(o) for o in out)
    return out


def _tree_map_tensors(fn, tree):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_map_tensors(fn, t) for t in tree)
    if isinstance(tree, dict):
        return {k: _tree_map_tensors(fn, v) for k, v in tree.items()}
    return tree


def _is_foreign_device(kwargs):
    d = kwargs.get("device")
    return d is not None and torch.device(d).type != DEVICE.type


# ---------------------------------------------------------------------------
# resolution
# ---------------------------------------------------------------------------


def _resolve(func):
    if isinstance(func, torch._ops.OpOverload) and "nested" in func._schema.name and func not in _reg.LOWERINGS:
        # (a jagged nested tensor's ops reach its own __torch_dispatch__, not this one; a lowering of one,
        # _nested_tensor_from_mask's, says what to do instead)
        handler, path = _refuse_nested, "refused"
    else:
        handler, path = _choose(func)
    unlaid = getattr(handler, "unlaid", None)
    handler = _checked(func, handler)
    _HANDLERS[func] = handler
    _BY_ID[id(func)] = (func, handler, handler if unlaid is None else _checked(func, unlaid))
    _PATHS[func] = path
    return handler


def _checked(func, handler):
    """``handler`` behind the checks and warnings every path of ``func`` makes."""
    handler = _checking_overlap(func, handler)
    if any(a.name == "device" for a in func._schema.arguments):
        handler = _checking_device_index(handler)
    if func in _reg.WARNINGS:
        handler = _warning_first(_reg.WARNINGS[func], handler)
    if isinstance(func, torch._ops.OpOverload) and func._schema.name in _INDEXING_OPS:
        handler = _indexing_host_self(handler)
    return handler


def _slice_inverse(func, args, kwargs):
    """``slice_inverse(view, base, ...)``: the view's storage seen with ``base``'s size, strides and
    offset (torch's kernel, an as_strided; functionalization's inverse of ``slice``)."""
    names = [a.name for a in func._schema.arguments]
    bound = {**dict(zip(names, args)), **kwargs}
    x, src = bound["self"], bound["src"]
    return aten.as_strided.default(x, src.shape, src.stride(), src.storage_offset())


def _refuse_nested(func, args, kwargs):
    raise _device.nested_refusal(str(func))


def _checking_device_index(handler):
    """``handler`` refusing a jax device index other than 0, as torch refuses a CUDA device
    that does not exist (``torch.zeros(1, device="jax:3")``)."""

    def checked(func, args, kwargs):
        device = kwargs.get("device") if kwargs else None
        if device is not None and not isinstance(device, torch.device):
            device = torch.device(device)
        if device is not None and device.index and device.type == DEVICE.type:
            raise RuntimeError(
                f"torch2jax: invalid device ordinal: {device} does not exist; the jax device is one torch device, "
                "jax:0 (torch.jax.device_count() == 1). To use several JAX devices, shard across them "
                "(t2j.parallel.make_mesh, shard_model, shard_batch)")
        return handler(func, args, kwargs)

    return checked


# ops whose index tensors torch moves to the indexed tensor's device (ATen's ``make_info``)
_INDEXING_OPS = frozenset(f"aten::{name}" for name in (
    "index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"))


def _indexing_host_self(handler):
    """``handler``, where a CPU tensor indexed with jax index tensors or masks (``cpu_x[jax_idx]``,
    ``cpu_x[jax_mask] = v``) is indexed on the CPU instead, with the indices (and a 0-dim jax
    value) copied there: torch moves index tensors to the device of the tensor they index, so a
    CUDA index works on a CPU tensor too."""

    def host(t):
        return t.cpu() if isinstance(t, Tensor) else t

    def run(func, args, kwargs):
        x = args[0] if args else kwargs.get("self")
        if isinstance(x, Tensor) or not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            return handler(func, args, kwargs)
        args, kwargs, moved = list(args), dict(kwargs), False
        for i, argument in enumerate(func._schema.arguments):
            where, key = (args, i) if i < len(args) else (kwargs, argument.name)
            if i >= len(args) and key not in kwargs:
                continue
            value = where[key]
            if argument.name == "indices" and any(isinstance(t, Tensor) for t in value):
                where[key], moved = [host(t) for t in value], True
            elif argument.name == "values" and isinstance(value, Tensor) and value.dim() == 0:
                where[key], moved = host(value), True
        if not moved:  # (a jax tensor of values into a CPU tensor: refused as torch does)
            return handler(func, args, kwargs)
        return func(*args, **kwargs)

    return run


def _warning_first(check, handler):
    def warned(func, args, kwargs):
        check(func, args, kwargs)
        return handler(func, args, kwargs)

    return warned


def _choose(func):
    if isinstance(func, torch._ops.OpOverload) and func.namespace not in ("aten", "prims"):
        from . import ops as _ops

        _ops.load_namespace(func.namespace)
    if func is aten.slice_inverse.default:
        return _slice_inverse, "decomposition"
    if func in _reg.VIEWS:
        return _lazy_bits(func, _view_handler(func, *_reg.VIEWS[func])), "lowering"
    if func in (aten.empty_strided.default, aten.new_empty_strided.default):
        return _strided_factory(_lowering_handler(func, _reg.LOWERINGS[func])), "lowering"
    if func in _reg.LOWERINGS:
        return _lowering_handler(func, _reg.LOWERINGS[func], _cpu_arguments(func)), "lowering"
    if isinstance(func, torch._ops.OpOverload) and func.is_view:
        if _has_composite(func):
            return _composite_handler, "decomposition"
        return _lazy_bits(func, _generic_view_handler), "lowering"
    if func is aten.resize_.default:
        return _resize_handler, "lowering"
    if func is aten.resize_as_.default:
        return _resize_as_handler, "lowering"
    if func in (aten.set_.source_Tensor, aten.set_.source_Tensor_storage_offset, aten.set_.default):
        return _set_handler, "lowering"
    if func in (aten.set_.source_Storage, aten.set_.source_Storage_storage_offset):
        return _set_storage_handler, "lowering"
    if func is aten.is_set_to.default:
        return _is_set_to_handler, "lowering"
    if func in _reg.DECOMPOSITIONS:  # ours, e.g. for ops that mutate lists of tensors
        return _decomposition_handler(_reg.DECOMPOSITIONS[func]), "decomposition"
    if isinstance(func, torch._ops.OpOverload) and func._schema.is_mutable:
        functional = functional_variant(func)
        if functional is not None and functional.is_view:
            return _inplace_view_handler(functional), "functional"
        if functional is not None:
            return _mutation_handler(func, functional), "functional"
    decomp = _decomposition(func)
    if decomp is not None:
        return _decomposition_handler(decomp), "decomposition"
    if _has_composite(func):
        return _composite_handler, "decomposition"
    custom = _custom_op_function(func)
    if custom is not None:
        return _custom_op_handler(custom), "decomposition"
    return _host_handler, "fallback"


DECOMPOSITION_DENYLIST: set = set()


def _decomposition(func):
    from torch._decomp import decomposition_table

    if func in _reg.DECOMPOSITIONS:
        return _reg.DECOMPOSITIONS[func]
    if func in DECOMPOSITION_DENYLIST:
        return None
    return decomposition_table.get(func)


def _custom_op_function(func):
    """The Python function of a ``torch.library.custom_op`` that serves the jax device: its
    kernel registered for "jax", else its device-agnostic one. It is written in torch ops, so
    it runs on jax tensors (and under jit) as a decomposition does; a kernel registered
    only for "cpu" or "cuda" is left to the host fallback."""
    # torch's prims are custom ops too, whose eager kernels assume real storages
    if not isinstance(func, torch._ops.OpOverload) or func.namespace in ("aten", "prims"):
        return None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func._schema.name)
    if opdef is None:
        return None
    return opdef._backend_fns.get(DEVICE.type) or opdef._backend_fns.get(None)


def _custom_op_handler(function):
    """A custom op's Python function, run as a decomposition. Traced, a function that needs its
    inputs' values (``offs.tolist()``, as transformers' grouped matmul fallback) runs on the
    host instead, its result shapes from the op's fake implementation (torch.compile leaves
    such an op out of its graph, too)."""

    def run(func, args, kwargs):
        COUNTERS["decompositions"] += 1
        try:
            return function(*args, **kwargs)
        except (ValueNeeded, jax.errors.ConcretizationTypeError) as e:  # (raised only while tracing)
            _sym.forget(e)
            return _host_handler(func, args, kwargs, f" that runs traced (its function needs its inputs' values: "
                                                     f"{type(e).__name__})")

    return run


def _has_composite(func):
    return isinstance(func, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeImplicitAutograd"
    )


def _lowering_handler(func, lowering, cpu_args=None):
    run = _plain_lowering_handler(func, lowering, cpu_args)
    layout_keywords = _reg.LAYOUT_KEYWORDS.get(func)
    if layout_keywords is not None:
        plain = run

        def run(func, args, kwargs):
            return plain(func, args, {**kwargs, **layout_keywords(args, kwargs)})

    strides = _reg.STRIDES.get(func)
    if strides is not None:
        def run_laid_out(func, args, kwargs):
            out = run(func, args, kwargs)
            if isinstance(out, (list, tuple)):
                return type(out)(_laid_out(o, st) for o, st in zip(out, strides(args, kwargs, out)))
            return _laid_out(out, strides(args, kwargs, (out,))[0])

        run_laid_out.unlaid = run
        return run_laid_out
    if _name_of(func) in _COLUMN_MAJOR_OPS:
        def run_column_major(func, args, kwargs):
            return _torch_layout(func, args, kwargs, run(func, args, kwargs))

        run_column_major.unlaid = run
        return run_column_major
    if not _keeps_layout(func):
        return run

    def run_keeping_layout(func, args, kwargs):
        if kwargs and kwargs.get("memory_format") in _RANK_OF_FORMAT:
            _check_format_rank(args[0], kwargs["memory_format"])
            return _torch_layout(func, args, kwargs, run(func, args, kwargs))
        out = run(func, args, kwargs)
        return _torch_layout(func, args, kwargs, out) if _layout_of_inputs(func, args) else out

    def run_unlaid(func, args, kwargs):
        if kwargs and kwargs.get("memory_format") in _RANK_OF_FORMAT:
            _check_format_rank(args[0], kwargs["memory_format"])
        return run(func, args, kwargs)

    run_keeping_layout.unlaid = run_unlaid
    return run_keeping_layout


# While `t2j.jit` traces, an op whose operands are all constants (none depends on the program's
# inputs: ``torch.arange(n, device=x.device)``, indices computed from CPU lengths) is computed at
# trace time where its results are small: its values are then known to the trace, which can read
# them (``.tolist()``, ``.cpu()``, a boolean mask) instead of stopping, as torch.compile folds
# constants. A large result is traced as usual, to stay out of the program's constants.
_FOLD_LIMIT = 4096


def _constant_operands(uargs, ukwargs) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((uargs, ukwargs)))


def _folded(lowering, uargs, ukwargs):
    with jax.ensure_compile_time_eval():
        out = lowering(*uargs, **ukwargs)
    # (a result that depends on the traced RNG key is no constant: running the lowering again would draw twice)
    if all(np.size(o) <= _FOLD_LIMIT or isinstance(o, jax.core.Tracer) for o in jax.tree.leaves(out)
           if hasattr(o, "shape")):
        return out
    return lowering(*uargs, **ukwargs)


def _plain_lowering_handler(func, lowering, cpu_args=None):
    compiled = _Compiled(lowering, _draws(func)) if _jittable(func, lowering) else None

    def run(func, args, kwargs):
        if kwargs and _is_foreign_device(kwargs):
            return _host_run(func, args, kwargs)
        try:
            if compiled is not None and compiled.enabled and _tensor.CAPTURE is None:
                if cpu_args is None:
                    uargs = _operands(args)
                    ukwargs = {k: _unwrap(v) for k, v in kwargs.items()} if kwargs else kwargs
                else:
                    uargs, ukwargs = _unwrap_call(cpu_args, args, kwargs)
                out = compiled(uargs, ukwargs)
                if type(out) is _ArrayImpl:
                    return new_tensor(_unshared(out, uargs))
                return _wrap(_unshared_all(out, uargs))
            if cpu_args is None:
                uargs = _unwrap(args)
                ukwargs = {k: _unwrap(v) for k, v in kwargs.items()} if kwargs else kwargs
            else:
                uargs, ukwargs = _unwrap_call(cpu_args, args, kwargs)
            if _tensor.CAPTURE is not None and _constant_operands(uargs, ukwargs):
                out = _folded(lowering, uargs, ukwargs)
            else:
                out = lowering(*uargs, **ukwargs)
        except HostFallback:
            return _host_handler(func, args, kwargs, " for these inputs")
        return _wrap(_unshared(out, uargs) if type(out) is _ArrayImpl else _unshared_all(out, uargs))

    return run


# -- result layout ----------------------------------------------------------------
#
# A lowering's result is a contiguous array; torch lays the result of these ops out
# like their inputs (TensorIterator's pointwise ops, the *_like factories, clone and
# _to_copy with preserve_format, softmax, cat...): ``(x.t() * 2).t().view(-1)`` and a
# channels_last tensor's ``relu(x).permute(0, 2, 3, 1).view(-1, c)`` are legal views
# in torch only because of that layout. Where an input is not contiguous, the result
# takes the strides torch's meta kernel gives it: it is made a permutation of a base
# stored in that memory order.

_LAYOUT_OPS = frozenset({
    "clone", "_to_copy", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "_softmax", "_log_softmax", "cat", "native_dropout", "bernoulli", "native_batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
    "convolution", "empty",
    # pooling, resizing and padding keep a channels_last input's layout; sort, flip, roll,
    # tril and triu lay out like their input
    "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool2d", "avg_pool3d",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    "upsample_trilinear3d", "constant_pad_nd", "reflection_pad2d", "reflection_pad3d", "replication_pad2d",
    "replication_pad3d", "native_group_norm", "sort", "flip", "roll", "tril", "triu",
    # elementwise in all but name (losses without reduction, glu's halves, stack's slices, index fills)
    "glu", "hardswish", "polar", "complex", "mse_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss",
    "huber_loss", "stack", "index_put", "index_fill", "_prelu_kernel",
})
# Ops whose CPU kernels give a channels_last result for a channels_last input where their
# meta kernels do not (torch's suggest_memory_format of the input)
_SUGGESTED_FORMAT_OPS = frozenset({
    "native_group_norm", "roll", "reflection_pad2d", "reflection_pad3d", "replication_pad2d", "replication_pad3d",
})
# Ops whose CPU kernels lay their result out in the input's suggested memory format: channels_last
# for a channels_last input, else contiguous (a transposed (N, C) input's batch norm is contiguous),
# where their meta kernels keep any layout of the input
_SUGGESTED_FORMAT_ONLY_OPS = frozenset({
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
})
_LAYOUTS: dict = {}
# LAPACK-backed ops whose CPU results are column-major (``torch.linalg.inv(A).stride() == (1, n)``), as
# their meta kernels say: their results always take the meta kernel's strides
_COLUMN_MAJOR_OPS = frozenset({
    "linalg_inv_ex", "linalg_cholesky_ex", "linalg_qr", "_linalg_eigh", "linalg_lu_factor_ex", "_linalg_solve_ex",
    "linalg_lstsq", "cholesky_solve", "linalg_solve_triangular", "triangular_solve", "cholesky_inverse",
    "linalg_householder_product", "orgqr", "ormqr", "linalg_ldl_factor_ex", "linalg_ldl_solve", "linalg_lu_solve",
    "lu_solve", "linalg_lu",
})


_RANK_OF_FORMAT = {torch.channels_last: 4, torch.channels_last_3d: 5}


def _check_format_rank(x, memory_format):
    """torch's error for a channels_last layout asked of a tensor (or a size) of another rank."""
    rank = len(x) if isinstance(x, (list, tuple)) else x.dim()
    if rank != _RANK_OF_FORMAT[memory_format]:
        name = str(memory_format).removeprefix("torch.")
        raise RuntimeError(f"required rank {_RANK_OF_FORMAT[memory_format]} tensor to use {name} format")


def _name_of(func) -> str | None:
    if isinstance(func, torch._ops.OpOverload) and func.namespace == "aten":
        return func._schema.name.split("::")[1]
    return None


def _keeps_layout(func):
    name = _name_of(func)
    if name is None or func._schema.is_mutable:
        return False
    return name in _LAYOUT_OPS or torch.Tag.pointwise in func.tags


def _layout_of_inputs(func, args) -> bool:
    """Whether the result of ``func`` (an op that lays its result out like its inputs) is not
    simply contiguous: an input is laid out otherwise."""
    sized_ones = False  # an input whose strides differ from the contiguous ones at size-1 dimensions only
    for a in args:
        if type(a) is Tensor:
            if not a._t2j_view:  # a base tensor is contiguous
                continue
            tensors = (a,)
        elif type(a) is list:
            tensors = [b for b in a if isinstance(b, torch.Tensor)]
        elif isinstance(a, torch.Tensor):
            tensors = (a,)
        else:
            continue
        for t in tensors:
            if t.stride() != _tensor._contiguous_strides(tuple(t.shape)):
                if not t.is_contiguous():
                    return True
                sized_ones = True
    return sized_ones and not _iterator_fast_path(func, args)


def _iterator_fast_path(func, args) -> bool:
    """Whether torch's CPU kernel takes TensorIterator's fast path, which makes a contiguous result
    for contiguous inputs whatever the strides of their size-1 dimensions (``relu(x)``, ``x * x``):
    a pointwise op whose tensor operands all have one shape. Otherwise (``x * 2``, ``x + bias``,
    ``clone``, ``zeros_like``) a channels_last ``(n, 1, h, w)`` input's strides ``(h * w, 1, w, 1)``
    are kept, as the meta kernel says."""
    if torch.Tag.pointwise not in func.tags or func in _INPUT_LIKE_POINTWISE:
        return False
    shapes = set()
    for a, arg in zip(args, func._schema.arguments):
        if isinstance(arg.type, torch.TensorType):
            if not isinstance(a, torch.Tensor):
                return False  # a number, wrapped as a 0-d tensor
            shapes.add(tuple(a.shape))
        elif arg.name in _WRAPPED_SCALARS:
            return False
    return len(shapes) == 1


# Scalar arguments that torch's kernels wrap as a 0-d tensor operand (``x + 2``: add.Scalar's
# ``other``), unlike those of ops that take them as parameters (clamp's ``min``, pow's ``exponent``)
_WRAPPED_SCALARS = frozenset({"self", "other", "n"})
# Pointwise ops whose CPU kernels allocate their result like their input (empty_like), or call one
# with a wrapped number (deg2rad multiplies, hardtanh / relu6 clamp through one)
_INPUT_LIKE_POINTWISE = frozenset({
    aten.clone.default, aten._conj_physical.default, aten.deg2rad.default, aten.rad2deg.default,
    aten.hardtanh.default, aten.relu6.default, aten.nan_to_num.default,
})


def _layout_key(a):
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.stride(), a.dtype, a.device.type)
    if isinstance(a, (list, tuple)):
        return tuple(_layout_key(b) for b in a)
    if isinstance(a, dict):
        return tuple((k, _layout_key(v)) for k, v in a.items())
    return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.memory_format)) else id(a)


def _torch_layout(func, args, kwargs, out):
    """``out`` with the strides torch gives this op's results for these inputs."""
    key = (func, _layout_key(args), _layout_key(kwargs))
    strides = _LAYOUTS.get(key, False)
    if strides is False:
        if len(_LAYOUTS) > 4096:  # shapes that keep changing: start over rather than grow
            _LAYOUTS.clear()
        strides = _LAYOUTS[key] = _meta_strides(func, args, kwargs)
    if strides is None:
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(_laid_out(o, st) for o, st in zip(out, strides))
    return _laid_out(out, strides[0])


def _meta_strides(func, args, kwargs):
    try:
        margs, mkwargs = _tree_map_tensors(_to_meta, (args, kwargs))
        if "device" in mkwargs:
            mkwargs["device"] = torch.device("meta")
        if "generator" in mkwargs:
            mkwargs["generator"] = None
        res = func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: the result stays contiguous
        return None
    res = res if isinstance(res, (list, tuple)) else (res,)
    name = func._schema.name.split("::")[1]
    if name in _SUGGESTED_FORMAT_ONLY_OPS:
        first = _channels_last_of(args[:1], res[0]) or _tensor._contiguous_strides(tuple(res[0].shape))
        return (first, *(r.stride() if isinstance(r, torch.Tensor) else None for r in res[1:]))
    operands = args[:2] if func is aten.convolution.default else args[:1] if name in _SUGGESTED_FORMAT_OPS else ()
    # torch's CPU kernels choose channels_last output from these operands; their meta kernels do not
    return tuple(_channels_last_of(operands, r) or r.stride() if isinstance(r, torch.Tensor) else None for r in res)


def _channels_last_of(operands, res):
    """channels_last strides for ``res`` where one of ``operands`` is channels_last (and not contiguous)."""
    if res.dim() not in (4, 5):
        return None
    fmt = torch.channels_last if res.dim() == 4 else torch.channels_last_3d
    if any(isinstance(a, torch.Tensor) and a.dim() == res.dim() and not a.is_contiguous()
           and a.is_contiguous(memory_format=fmt) for a in operands):
        return torch.empty(res.shape, device="meta", memory_format=fmt).stride()
    return None


def _laid_out(t, strides):
    if not isinstance(t, Tensor) or strides is None or tuple(strides) == t.stride():
        return t
    shape = tuple(t.shape)
    perm = _tensor.dense_order(shape, strides) if t.dim() >= 2 else None
    if perm is not None:
        base = new_tensor(jax.numpy.transpose(t._value(), perm), requires_grad=False)
        out = dispatch(aten.permute.default, (base, list(np.argsort(perm))), {})
        if out.stride() != tuple(strides):  # a size-1 dimension's stride, which addresses nothing
            out = Tensor(out._t2j_storage, out._t2j_view, value=out._value(), size=shape, stride=tuple(strides))
        return out
    # gaps or overlaps: the storage torch allocates (one past the furthest element), seen
    # through those strides, so that overlapping elements are one
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    value = t._value()
    flat = new_tensor(jax.numpy.zeros((extent,), value.dtype), requires_grad=False)
    out = dispatch(aten.as_strided.default, (flat, shape, tuple(strides), 0), {})
    out._assign(value)
    return out


def _decomposition_handler(decomp):
    def run(func, args, kwargs):
        COUNTERS["decompositions"] += 1
        return decomp(*args, **kwargs)

    return run


def _composite_handler(func, args, kwargs):
    COUNTERS["decompositions"] += 1
    return func.decompose(*args, **kwargs)


def _compute(func, args, kwargs):
    """Run ``func`` functionally and return its results as arrays (laid out as they come: an
    in-place op through a transposed view would transpose its result for torch's strides, then
    back to read it)."""
    return _array_of(dispatch(func, args, kwargs, laid_out=False))


# ---------------------------------------------------------------------------
# compiled lowerings
# ---------------------------------------------------------------------------
#
# Outside jit, JAX dispatches every primitive a lowering binds on its own, and a
# primitive bound directly (lax.dot_general, lax.transpose) takes JAX's slow
# Python path (about 50 us on CPU, against 10 us for a jitted call). A lowering
# whose result depends only on its arrays' shapes and dtypes, its other
# (static) arguments and a few global settings therefore runs as one jax.jit
# call, compiled once per such signature.

# A lowering that refers to one of these names may act differently when traced:
# value checks skipped for tracers (index bounds, integer division by zero),
# RNG state advanced, a warning issued once per trace instead of once per call,
# the scoped config or torch's deterministic fill read (neither is part of the
# cache key). It always runs op by op.
_TRACE_SENSITIVE = frozenset(
    {
        "Tracer",
        "_traced",
        "ensure_compile_time_eval",
        "ConcretizationTypeError",
        "TracerArrayConversionError",
        "TracerBoolConversionError",
        "TracerIntegerConversionError",
        "is_traced_number",
        "next_key",
        "warn",
        "device_get",
        "pure_callback",
        "CAPTURE",
        "dispatch",
        "config",
        "uninitialized",
    }
)

_READS_PRECISION = frozenset({"get_float32_matmul_precision"})
_CHECKS_VALUES = frozenset({"check_values"})
# What a random op's lowering names to draw a key (`env.next_key`): its compiled call passes the key in
_DRAWING = frozenset({"next_key"})

# The calls of a signature that run op by op before it is compiled. None: XLA fuses a lowering's
# primitives, which can change a result's last bit, so every call of an op with one signature runs
# one program and the same eager code gives the same bits on every run (a training loop run twice
# with one seed). One compile of a lowering also costs less than its primitives' compiles op by op
# (HF models' eager tests: 102 s against 134 s).
_COMPILE_AFTER = 0
_MAX_SIGNATURES = 4096
# Float values a compiled program may simplify as constants (see `_Compiled._float_inputs`): they are
# keyed by value, with a program each.
_STATIC_FLOATS = frozenset({0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, 4.0, math.inf, -math.inf})
# Floats within this bound fit every dtype (int8 the narrowest), so torch's check that a Scalar fits the
# result dtype (`registry.checked_scalar`) cannot fail for them: only they may be inputs of a program,
# where the check would see a tracer; any other value is static, checked when its program is traced.
_CHECK_FREE = 127.0
# Programs of one signature at different static float values, beyond which its other values run op by op
_MAX_FLOAT_VALUES = 16

# Values that may be static arguments of a compiled lowering: hashable, and
# equal only when the lowering treats them alike (see `_key`).
_STATIC_TYPES = frozenset(
    {type(None), bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format}
)
_ARRAY = object()
_FLOAT = object()
_OP_BY_OP = object()
_BOOL = np.dtype(np.bool_)


class _NotStatic(Exception):
    """An argument that keeps the call op by op: one that cannot be part of the
    cache key, or a bool array (see `_key`)."""


class _NotArrays(Exception):
    """A lowering returned something other than arrays when traced (a Python number, a NumPy constant)."""


def _jittable(func, lowering):
    """Whether ``lowering`` of ``func`` may run as a compiled call (see `_TRACE_SENSITIVE`); a random
    op's draws from the RNG stream are inputs and outputs of its program (`_Compiled.draws`)."""
    if not isinstance(func, torch._ops.OpOverload) or func in _reg.OP_BY_OP:
        return False
    returns = func._schema.returns
    if not returns or any(str(r.type) not in ("Tensor", "List[Tensor]") for r in returns):
        return False
    if torch.Tag.dynamic_output_shape in func.tags and func is not torch.ops.aten.index.Tensor:
        return False  # (index's shape depends on values only through a boolean mask: such calls run op by op)
    return not _refers_to(lowering, _TRACE_SENSITIVE - _DRAWING if _draws(func) else _TRACE_SENSITIVE)


def _draws(func) -> bool:
    """Whether ``func`` draws random numbers (from the RNG stream, or a generator it is passed)."""
    return torch.Tag.nondeterministic_seeded in func.tags


def _refers_to(fn, names) -> bool:
    """Whether ``fn``, or a torch2jax function it may call, names one of ``names``.

    Follows the torch2jax functions its code reaches through globals, module
    attributes, closures, partials and nested functions; methods, other
    packages' code and functions marked `registry.traced_numbers_only` or ``not_followed``
    (`registry.check_values`) are not followed.
    """
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if isinstance(f, functools.partial):
            todo.append(f.func)
            continue
        code = getattr(f, "__code__", None)
        if code is None or code in seen or getattr(f, "traced_numbers_only", False) \
                or getattr(f, "not_followed", False):
            continue
        seen.add(code)
        todo.extend(c.cell_contents for c in f.__closure__ or () if callable(_cell(c)))
        codes, scope = [code], f.__globals__
        while codes:
            c = codes.pop()
            if not names.isdisjoint(c.co_names):
                return True
            for name in c.co_names:
                v = scope.get(name)
                if isinstance(v, types.FunctionType) and v.__module__.startswith("torch2jax"):
                    todo.append(v)
                elif isinstance(v, types.ModuleType) and v.__name__.startswith("torch2jax"):
                    todo.extend(
                        w
                        for w in (getattr(v, m, None) for m in c.co_names)
                        if isinstance(w, types.FunctionType) and w.__module__.startswith("torch2jax")
                    )
            codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return False


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


class _View:
    """A view operand whose value is not computed yet: its storage's array and view
    chain go into the compiled lowering that reads it."""

    __slots__ = ("tensor", "steps")

    def __init__(self, tensor, steps):
        self.tensor = tensor
        self.steps = steps


def _operand(t):
    """``t``'s array, or a `_View` of it when it is a view not computed yet that a compiled call can compute."""
    chain = t._t2j_view
    if chain and t._t2j_version != t._t2j_storage.version:
        for step in chain:
            if step.key is None:
                return t._value()
        return _View(t, chain)
    return t._value()


def _operands(args):
    """The arguments of a compiled lowering: tensors as `_operand`, the rest unwrapped."""
    out = []
    for a in args:
        if type(a) is not Tensor:
            out.append(_unwrap(a))
        elif a._t2j_view:
            out.append(_operand(a))
        else:  # a base tensor, the commonest operand: its storage's array
            out.append(a._t2j_storage.array)
    return out


def _materialize(args):
    return [a.tensor._value() if type(a) is _View else a for a in args]


def _key(a, arrays, key):
    """Append ``a``'s arrays to ``arrays`` and what a compiled call of it depends on to ``key``.

    Python numbers are keyed with their type (``1``, ``1.0`` and ``True`` promote
    differently) and floats by their bits (``-0.0`` is not ``0.0``; NaN is itself).
    """
    t = type(a)
    if t is _ArrayImpl:
        arrays.append(a)
        key.append(a.aval)
    elif t is float:
        key.append(a.hex())
    elif t in _STATIC_TYPES:
        key.append((t, a))
    elif t is list or t is tuple or t is torch.Size:
        key.append((t, len(a)))
        for b in a:
            _key(b, arrays, key)
    elif t is complex:
        key.append((a.real.hex(), a.imag.hex()))
    elif t is _View:
        base = a.tensor._t2j_storage.array
        if type(base) is not _ArrayImpl:
            raise _NotStatic
        arrays.append(base)
        key.append((base.aval, tuple(step.key for step in a.steps)))
        for step in a.steps:
            arrays.extend(step.positions)
    else:
        raise _NotStatic


def _template(a, float_inputs=False):
    """``a`` with each array replaced by a placeholder and each `_View` by its view chain (see `_fill`);
    with ``float_inputs``, each Python float by a placeholder too (an input of the program)."""
    t = type(a)
    if t is _ArrayImpl:
        return _ARRAY
    if t is _View:
        return a.steps
    if t is float and float_inputs:
        return _FLOAT
    if t is list or t is tuple or t is torch.Size:
        return t([_template(b, float_inputs) for b in a])
    return a


def _fill(template, arrays, floats=None):
    if template is _ARRAY:
        return next(arrays)
    if template is _FLOAT:
        return next(floats)
    t = type(template)
    if t is tuple and template and type(template[0]) is ViewStep:
        value = next(arrays)
        for step in template:
            value = step.trace(value, *[next(arrays) for _ in step.positions])
        return value
    if t is list or t is tuple or t is torch.Size:
        return t([_fill(b, arrays, floats) for b in template])
    return template


def _floats(a, out):
    """Append the Python floats in ``a`` to ``out``, in `_key`'s order."""
    t = type(a)
    if t is float:
        out.append(a)
    elif t is list or t is tuple or t is torch.Size:
        for b in a:
            _floats(b, out)
    return out


def _same_bits(a, b) -> bool:
    """Whether two results of a lowering (arrays, or lists and tuples of them) are the same bits."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_bits, a, b))
    if a is None or b is None:
        return a is b
    return a.aval == b.aval and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _all_traced(out):
    if isinstance(out, jax.core.Tracer) or out is None:
        return True
    return isinstance(out, (list, tuple)) and all(_all_traced(o) for o in out)


# What `_eager` and `_Compiled` read once per op, bound without the Python
# wrappers around them (`jax.core.trace_ctx.trace`, `torch.get_float32_matmul_precision`).
_TRACE = _jax_core.trace_state_strong_ref
_EvalTrace = _jax_core.EvalTrace
_matmul_precision = torch._C._get_float32_matmul_precision


_grad_enabled = torch.is_grad_enabled
_get_ident = threading.get_ident


def _eager():
    """Whether JAX is running eagerly (no jit, grad or vmap trace is active)."""
    return isinstance(_TRACE.value, _EvalTrace)


class _Compiled:
    """``fn`` (a lowering over arrays) run as jax.jit-compiled calls, one per signature.

    A signature is the op's static arguments, its arrays' shapes, dtypes and weak
    types (and the view ops applied to them, for `_View` operands), and the
    global settings lowerings read (default dtype, float32 matmul precision).
    Arguments of other types, and traced arrays, run ``fn`` directly. If tracing
    fails where ``fn`` itself succeeds, ``fn`` depends on its values and is not
    compiled again.

    Python floats (``leaky_relu``'s slope, ``layer_norm``'s eps, the momentum
    ``BatchNorm(momentum=None)`` changes every step) are keyed by value at first. Once
    a signature sees a second value, its floats become inputs of one program (as
    `t2j.jit` passes traced numbers: weakly typed 0-d float64 arrays), which is kept
    if it gives the first value's program's bits at the first value; a lowering that
    needs a float's value (``if p == 2``) or computes otherwise with it traced keeps
    its floats static, and runs op by op after `_MAX_FLOAT_VALUES` of them (see
    `_float_inputs`).
    """

    __slots__ = ("fn", "enabled", "signatures", "reads_precision", "by_floats", "checks_values", "draws")

    def __init__(self, fn, draws=False):
        self.fn = fn
        # A random op's program takes the RNG stream's key and gives it back split as often as the
        # lowering draws (`_call_drawing`)
        self.draws = draws
        self.enabled = True
        self.signatures: dict = {}
        # Only the matmul lowerings read torch's float32 matmul precision; the others
        # spare a call into torch per op (each costs more here than on its own).
        self.reads_precision = _refers_to(fn, _READS_PRECISION)
        # A lowering that checks values (indices, class labels) is compiled with its checks as outputs
        self.checks_values = _refers_to(fn, _CHECKS_VALUES)
        # signature with its floats left out -> `_FloatInputs` (see `_float_inputs`)
        self.by_floats: dict = {}

    def __call__(self, args, kwargs):
        """``fn(*args, **kwargs)``; ``args`` may hold `_View` operands (a list, not nested)."""
        if not self.enabled or not isinstance(_TRACE.value, _EvalTrace):
            return self.fn(*_materialize(args), **kwargs)
        arrays, key = [], [torch.get_default_dtype()]
        if self.reads_precision:
            key.append(_matmul_precision())
        try:
            for a in args:
                if type(a) is _ArrayImpl:
                    # `_key` of the commonest operand, inline: this loop runs once per op
                    arrays.append(a)
                    key.append(a.aval)
                else:
                    _key(a, arrays, key)
            if kwargs:
                for v in kwargs.values():
                    _key(v, arrays, key)
                key.append(tuple(kwargs))
        except _NotStatic:
            return self.fn(*_materialize(args), **kwargs)
        key = tuple(key)
        if self.draws:
            return self._call_drawing(key, arrays, args, kwargs)
        compiled = self.signatures.get(key)
        if compiled is _OP_BY_OP:
            return self.fn(*_materialize(args), **kwargs)
        if compiled is None or type(compiled) is int:
            if any(type(k) is str for k in key[1 + self.reads_precision:]):  # a float (see `_key`)
                compiled = self._float_inputs(key, arrays, args, kwargs)
                if compiled is _OP_BY_OP:
                    return self.fn(*_materialize(args), **kwargs)
                if compiled is not None:
                    compiled, arrays = compiled
            if compiled is None or type(compiled) is int:
                seen = (compiled or 0) + 1
                if seen <= _COMPILE_AFTER:
                    if len(self.signatures) >= _MAX_SIGNATURES:
                        self.signatures.clear()
                    self.signatures[key] = seen
                    return self.fn(*_materialize(args), **kwargs)
                compiled = self._compile(args, kwargs)
                if _converts_bool_inputs(compiled, arrays):
                    self.signatures[key] = _OP_BY_OP
                    return self.fn(*_materialize(args), **kwargs)
                self.signatures[key] = compiled
        try:
            return compiled(*arrays)
        except _CheckFailed as failed:
            raise failed.error from None
        except Exception as error:  # noqa: BLE001 - the op-by-op run below raises the input's real error
            out = self.fn(*_materialize(args), **kwargs)
            if isinstance(error, OpError):  # (a shape that depends on values in this signature: x[uint8 mask])
                self.signatures[key] = _OP_BY_OP
                return out
            self.enabled = False
            self.signatures.clear()
            self.by_floats.clear()
            return out

    def _call_drawing(self, key, arrays, args, kwargs):
        """A random op's call: its program draws from the default stream's key, an input, and gives
        back the key after its draws, which the stream continues from. Its bits are the op-by-op
        run's (the same splits of the same key). Its floats (dropout's p) stay static. Inside a
        `t2j.rng_key` block, or with bool operands, it runs op by op."""
        rng = _env.default_rng
        compiled = self.signatures.get(key)
        if compiled is _OP_BY_OP or rng.stream_key() is not rng.key or _has_bool(arrays):
            return self.fn(*_materialize(args), **kwargs)
        if compiled is None:
            if len(self.signatures) >= _MAX_SIGNATURES:
                self.signatures.clear()
            if self._another_float_value(key) > _MAX_FLOAT_VALUES:  # (``x.normal_(0, sigma)``, sigma annealed)
                self.signatures[key] = _OP_BY_OP
                return self.fn(*_materialize(args), **kwargs)
            compiled = self.signatures[key] = self._compile(args, kwargs, draws=True)
        try:
            out, rng.key = compiled(*arrays, rng.key)
        except _CheckFailed as failed:
            raise failed.error from None
        except Exception:  # noqa: BLE001 - the op-by-op run raises the input's real error
            out = self.fn(*_materialize(args), **kwargs)
            self.signatures[key] = _OP_BY_OP
        return out

    def _another_float_value(self, key) -> int:
        """How many programs the signature ``key`` with its floats left out has, with one more for
        ``key`` (0 for a ``key`` without floats)."""
        if not any(type(k) is str for k in key[1 + self.reads_precision:]):
            return 0
        entry = self._float_entry(key)
        entry.static += 1
        return entry.static

    def _float_entry(self, key):
        """The `_FloatInputs` of the signature ``key`` with its floats left out."""
        start = 1 + self.reads_precision
        abstract = key[:start] + tuple(_FLOAT if type(k) is str else k for k in key[start:])
        entry = self.by_floats.get(abstract)
        if entry is None:
            if len(self.by_floats) >= _MAX_SIGNATURES:
                self.by_floats.clear()
            entry = self.by_floats[abstract] = _FloatInputs()
        return entry

    def _float_inputs(self, key, arrays, args, kwargs):
        """For a call whose ``key`` (not compiled yet) holds floats: (program, its inputs) where
        its floats are inputs of the program; None where they stay static (``key``'s own program,
        compiled by the caller); `_OP_BY_OP` to run the call op by op.

        The first signature whose floats are all ordinary (`_STATIC_FLOATS`) is the reference; at
        a second value, the program taking the floats as inputs is tried at the reference's
        values and kept where its results are the reference program's bits. XLA simplifies
        arithmetic with some constants (``x * 1``, ``x + 0``, ``x ** 2`` as ``x * x``), so such
        values keep a program of their own."""
        entry = self._float_entry(key)
        floats = _floats(list(args), [])
        if kwargs:
            _floats(list(kwargs.values()), floats)
        ordinary = not any(f in _STATIC_FLOATS or not -_CHECK_FREE <= f <= _CHECK_FREE for f in floats)
        if entry.program:
            return (entry.program, arrays + floats) if ordinary else None
        if entry.static >= _MAX_FLOAT_VALUES:
            return _OP_BY_OP
        entry.static += 1
        if not ordinary or entry.program is False or _has_bool(arrays):
            return None
        reference = entry.reference and self.signatures.get(entry.reference[0])
        if reference is None or type(reference) is int:
            entry.reference = (key, floats)
            return None
        program = self._compile(args, kwargs, float_inputs=len(arrays))
        try:
            same = _same_bits(program(*arrays, *entry.reference[1]), reference(*arrays))
        except Exception:  # noqa: BLE001 - a lowering that needs its floats' values (``if eps > 0``)
            same = False
        if not same:
            entry.program = False
            return None
        entry.program = program
        entry.static = 0
        return program, arrays + floats

    def _compile(self, args, kwargs, float_inputs=None, draws=False):
        """The program of ``fn`` at these arguments' signature; with ``float_inputs`` (the number of
        its arrays), one that takes the arguments' floats as inputs after the arrays; with ``draws``,
        one that takes the RNG stream's key after its arrays and returns the key after its draws."""
        fn = self.fn
        as_inputs = float_inputs is not None
        targs = _template(list(args), as_inputs)
        tkwargs = {k: _template(v, as_inputs) for k, v in kwargs.items()} if kwargs else None

        def traced(*arrays):
            it = iter(arrays)
            floats = iter(arrays[float_inputs:]) if as_inputs else None
            args = _fill(targs, it, floats)
            out = fn(*args, **{k: _fill(v, it, floats) for k, v in tkwargs.items()}) if tkwargs else fn(*args)
            if not _all_traced(out):
                raise _NotArrays
            return out

        body = traced
        if draws:
            def body(*arrays):
                with _env.default_rng.traced_key(arrays[-1]) as stream:
                    out = traced(*arrays[:-1])
                return out, stream.key

        if not self.checks_values:
            return jax.jit(body)
        program = _CheckingProgram()

        def checking(*arrays):
            with _reg.deferred_checks() as program.checks:
                out = body(*arrays)
            return out, program.checks.outputs()

        program.jitted = jax.jit(checking)
        return program


class _CheckFailed(Exception):
    """A compiled eager call's value check failed: ``error`` is torch's error for it."""

    def __init__(self, error):
        super().__init__(error)
        self.error = error


class _CheckingProgram:
    """A compiled lowering that checks values (`registry.check_values`): ``jitted`` returns its
    results and its checks' outcomes (``checks``, recorded when it was traced), which this call
    raises the first failed one of (`_CheckFailed`), as the op-by-op run raises it."""

    __slots__ = ("jitted", "checks")

    def __call__(self, *arrays):
        out, outcome = self.jitted(*arrays)
        try:
            self.checks.raise_failed(outcome)
        except Exception as error:  # noqa: BLE001 - the op's own error (IndexError, RuntimeError...)
            raise _CheckFailed(error) from None
        return out


def _has_bool(arrays) -> bool:
    # (``arrays`` may hold a view step's integer positions)
    return any(getattr(a, "dtype", None) == _BOOL for a in arrays)


def _converts_bool_inputs(program, arrays) -> bool:
    """Whether ``program`` at ``arrays``, some of them bool, converts a bool to a number: XLA
    rewrites arithmetic on a converted bool into a select (False * nan -> 0, where torch and
    JAX's op-by-op run give nan), so such a lowering runs op by op. Where, masks and logical
    ops on bool arrays stay one program."""
    if not _has_bool(arrays):
        return False
    try:
        todo = [jax.make_jaxpr(getattr(program, "jitted", program))(*arrays).jaxpr]
    except Exception:  # noqa: BLE001 - a lowering refusing its inputs raises its own error op by op
        return True
    while todo:
        jaxpr = todo.pop()
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype == _BOOL \
                    and eqn.params["new_dtype"] != _BOOL:
                return True
            todo.extend(jax.extend.core.jaxprs_in_params(eqn.params))
    return False


class _FloatInputs:
    """What `_Compiled._float_inputs` knows of one signature with its floats left out: the
    program taking them as inputs (None: not tried yet; False: its floats stay static), the
    reference (key, floats) it is checked against, and how many static programs it has."""

    __slots__ = ("program", "reference", "static")

    def __init__(self):
        self.program = None
        self.reference = None
        self.static = 0


# ---------------------------------------------------------------------------
# views
# ---------------------------------------------------------------------------


def _meta_view(func, size, stride, offset, storage_numel, dtype, args, kwargs):
    base = torch.empty(storage_numel, dtype=dtype, device="meta").as_strided(size, stride, offset)
    out = func(base, *args, **dict(kwargs))
    if getattr(out, "dtype", None) is torch.complex32:  # view_as_complex of float16 (raised before it is cached)
        raise _dt.Complex32Needed("torch2jax: a complex32 view, held as complex64")
    if isinstance(out, (list, tuple)):
        return [(tuple(o.shape), o.stride(), o.storage_offset(), o.dtype) for o in out]
    return (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype)


def _hashable(a):
    """``a`` with its lists made tuples (the meta kernels take either)."""
    if type(a) is list or type(a) is tuple and any(type(b) is list for b in a):
        return tuple(_hashable(b) for b in a)
    return a


def _storage_numel(x):
    arr = x._t2j_storage.array
    return math.prod(arr.shape) * arr.dtype.itemsize // x.dtype.itemsize


# (op, input size, strides, offset, storage size, dtype, arguments) -> `_meta_view`'s answer
_VIEW_METAS: dict = {}
_MAX_VIEW_METAS = 65536


def _view_meta(func, x, rest, kwargs):
    """(size, stride, storage_offset, dtype) torch gives the view, from its meta kernel."""
    args = _hashable(rest)
    kwargs_key = tuple(sorted((k, _hashable(v)) for k, v in kwargs.items())) if kwargs else ()
    key = (func, x.shape, x.stride(), x.storage_offset(), _storage_numel(x), x.dtype, args, kwargs_key)
    try:
        meta = _VIEW_METAS.get(key)
    except TypeError:  # an unhashable argument: compute without the cache
        return _meta_view(*key)
    if meta is None:
        if len(_VIEW_METAS) >= _MAX_VIEW_METAS:
            _VIEW_METAS.clear()
        meta = _VIEW_METAS[key] = _meta_view(*key)
    return meta


def _make_view(x, step, value, meta):
    size, stride, offset, dtype = meta
    chain = x._t2j_view + (step,) if step is not None else x._t2j_view
    return Tensor(x._t2j_storage, chain, value=value, size=size, stride=stride, offset=offset, dtype=dtype)


def _alias(x, step=None):
    """A tensor of ``x``'s storage, chain and metadata, through one more ``step`` if given."""
    # autograd detaches every output it saves for backward: no meta kernel on this path
    value, chain = x._value(), x._t2j_view
    if step is not None:
        value, chain = step.forward(value), chain + (step,)
    return Tensor(
        x._t2j_storage, chain, value=value,
        size=x.shape, stride=x.stride(), offset=x.storage_offset(), dtype=x.dtype,
    )


def _lazy_bits(view_op, run):
    """``run``, the handler of ``view_op``, giving its views torch's conjugate and negative bits.

    A torch2jax tensor's value is always what it reads as: ``z.conj()`` holds the
    conjugated values (a write through it reaches ``z`` conjugated back), ``_neg_view``
    the negated ones. The bits only tell torch and the user what kind of view it is:
    ``is_conj()``, ``resolve_conj()`` (a copy), torch's refusal of ``view_as_real`` and
    dtype views of a conjugate view. ``_conj`` and ``_neg_view`` toggle theirs; every
    other view keeps its input's. Ops that do not take such views get a copy from torch
    first (its conjugate and negative fallbacks), which reads the same values."""

    toggles_conj, toggles_neg = view_op is aten._conj.default, view_op is aten._neg_view.default
    refused_on_conj = view_op in _CONJ_REFUSED

    def run_with_bits(func, args, kwargs):
        x = args[0]
        conj, neg = x.is_conj(), x.is_neg()
        if conj and refused_on_conj:
            meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
            torch._C._set_conj(meta, True)
            func(meta, *args[1:], **kwargs)  # torch's error
        inference = x.is_inference()
        if inference != torch.is_inference_mode_enabled():
            # torch's view of a normal tensor is a normal tensor (autograd then shares its
            # version counter), also under inference_mode; a view of an inference tensor is
            # one (torch refuses to write to it, or save it for backward, outside inference_mode)
            with torch.inference_mode(inference):
                out = run(func, args, kwargs)
        else:
            out = run(func, args, kwargs)
        conj ^= toggles_conj
        neg ^= toggles_neg
        if conj or neg:
            for o in (out if isinstance(out, (list, tuple)) else (out,)):
                torch._C._set_conj(o, conj)
                torch._C._set_neg(o, neg)
        return out

    return run_with_bits


_CONJ_REFUSED = frozenset({aten.view_as_real.default, aten.view.dtype})


def _view_handler(func, forward, inverse):
    # An alias's forward returns its input: nothing to compile.
    jittable = inverse is not None and _jittable(func, forward) and _jittable(func, inverse)
    compiled_forward = _Compiled(forward) if jittable else None
    compiled_inverse = _Compiled(inverse) if jittable else None
    steps: dict = {}  # a ViewStep per static key: one op with the same arguments is one step

    def run(func, args, kwargs):
        x, rest = args[0], args[1:]
        if func is aten.select.int and _sym.is_traced_number(rest[1]):
            return _traced_select(x, rest[0], rest[1])
        if func is aten.slice.Tensor and any(map(_sym.is_traced_number, rest)):
            return _traced_slice(x, *rest)
        if inverse is None:  # an alias (detach, alias, lift_fresh): x's value, chain and metadata
            if func is aten.detach.default and _gradcut.user_detach(x._t2j_storage.array):
                return _alias(x, _tensor.DETACHED)
            return _alias(x)
        meta = _view_meta(func, x, rest, kwargs)
        urest = _unwrap(rest)
        if isinstance(meta, list):
            value = forward(x._value(), *urest, **kwargs)
            return [
                _make_view(
                    x,
                    ViewStep(_pick(forward, i, urest, kwargs), _pick_inverse(inverse, i, urest, kwargs), func,
                             call=(func, urest, kwargs, i)),
                    v,
                    m,
                )
                for i, (v, m) in enumerate(zip(value, meta))
            ]
        if func in _POSITIONED and _tensor.CAPTURE is None and _eager() and not kwargs and \
                (step := _positioned_step(func, x, urest, meta)) is not None:
            size, stride, offset, dtype = meta
            return _tensor.lazy_view(x._t2j_storage, x._t2j_view + (step,), size, stride, offset, dtype)
        if compiled_forward is None:
            step = ViewStep(
                functools.partial(_apply_forward, forward, urest, kwargs),
                functools.partial(_apply_inverse, inverse, urest, kwargs),
                func,
                call=(func, urest, kwargs, None),
            )
            return _make_view(x, step, step.forward(x._value()), meta)
        key = _static_key(func, urest, kwargs)
        step = steps.get(key) if key is not None else None
        if step is None:
            step = ViewStep(
                functools.partial(_apply_compiled_forward, compiled_forward, urest, kwargs),
                functools.partial(_apply_compiled_inverse, compiled_inverse, urest, kwargs),
                func,
                key,
                functools.partial(_apply_forward, forward, urest, kwargs),
                call=(func, urest, kwargs, None),
            )
            if key is not None:
                if len(steps) >= _MAX_SIGNATURES:
                    steps.clear()
                steps[key] = step
        if key is not None and _tensor.CAPTURE is None and _eager():
            # Computed when first read: a compiled lowering reading it computes it in its own program.
            size, stride, offset, dtype = meta
            return _tensor.lazy_view(x._t2j_storage, x._t2j_view + (step,), size, stride, offset, dtype)
        return _make_view(x, step, step.forward(x._value()), meta)

    return run


# Eager views at an integer position, ``x[i]`` and ``x[i:i + k]``, pass where they start to the programs
# that compute them (`ViewStep.positions`): with the position static, a loop over a tensor's rows or
# minibatches compiled a program for each (125 ms per minibatch of a first epoch).
_POSITIONED = frozenset({aten.select.int, aten.slice.Tensor})


def _positioned_step(func, x, rest, meta):
    """The `ViewStep` of ``func(x, *rest)`` (``select`` or ``slice`` with integer arguments; the view's
    ``meta`` checked them) at a position its programs take as an input, or None."""
    if not all(type(r) is int or r is None for r in rest):
        return None
    d = _reg.canonical_dim(rest[0] if rest else 0, x.dim())
    if func is aten.select.int:
        index = rest[1]
        at = index + x.shape[d] if index < 0 else index
        key = (func, d)
        return ViewStep(functools.partial(_select_at, at=at, dim=d),
                        functools.partial(_select_at_inverse, at=at, dim=d), func, key,
                        functools.partial(_select_at, dim=d), call=(func, rest, {}, None), positions=(at,))
    start, end, step = (*rest[1:], None, None, None)[:3]
    start, _, step = slice(start, end, step or 1).indices(x.shape[d])
    length = meta[0][d]
    key = (func, d, length, step)
    return ViewStep(functools.partial(_slice_at, start=start, dim=d, length=length, step=step),
                    functools.partial(_slice_at_inverse, start=start, dim=d, length=length, step=step),
                    func, key, functools.partial(_slice_at, dim=d, length=length, step=step),
                    call=(func, rest, {}, None), positions=(start,))


@functools.partial(jax.jit, static_argnames=("dim",))
def _select_at(a, at, dim):
    return jax.lax.dynamic_index_in_dim(a, at, dim, keepdims=False)


@functools.partial(jax.jit, static_argnames=("dim",))
def _select_at_inverse(base, value, at, dim):
    return jax.lax.dynamic_update_index_in_dim(base, value.astype(base.dtype), at, dim)


def _strided_span(length, step):
    """How many elements of its input a slice of ``length`` elements ``step`` apart spans."""
    return (length - 1) * step + 1 if length else 0


@functools.partial(jax.jit, static_argnames=("dim", "length", "step"))
def _slice_at(a, start, dim, length, step):
    span = jax.lax.dynamic_slice_in_dim(a, start, _strided_span(length, step), dim)
    return span if step == 1 else jax.lax.slice_in_dim(span, 0, None, step, dim)


@functools.partial(jax.jit, static_argnames=("dim", "length", "step"))
def _slice_at_inverse(base, value, start, dim, length, step):
    value = value.astype(base.dtype)
    if step != 1:
        span = jax.lax.dynamic_slice_in_dim(base, start, _strided_span(length, step), dim)
        value = span.at[(slice(None),) * dim + (slice(None, None, step),)].set(value)
    return jax.lax.dynamic_update_slice_in_dim(base, value, start, dim)


def _traced_select(x, dim, index):
    """``x.select(dim, index)`` where ``index`` is a traced number: a view reading and writing
    one slice at a position the program computes (``alphas[t]`` with the step ``t`` an input
    of a jitted program, so that one program serves every step).

    torch's bounds check becomes a guard on the number input (a call with an index out of
    range retraces, and raises torch's IndexError) where the index has a value at trace time;
    a number computed in the program (``t.item()``) is checked when the program runs."""
    d = _reg.canonical_dim(dim, x.dim())
    n = x.shape[d]
    node = index.node
    message = "select(): index {} out of range for tensor of size " + f"{list(x.shape)} at dimension {dim}"
    if node.hint is not None and _sym.GUARDS is not None:
        if not -n <= node.hint < n:
            raise IndexError(message.format(node.hint))
        replay = node.replay
        _sym.GUARDS.append(_sym.Guard(lambda values: -n <= replay(values) < n, bool, True, node.inputs))
        position = node.hint % n
    else:
        i = _sym.value_of(index)
        _sym.check_when_run((i < -n) | (i >= n), lambda v: IndexError(message.format(v)), i)
        position = 0  # the metadata's offset only; the steps find the elements
    i = jax.numpy.asarray(_sym.value_of(index))
    at = jax.numpy.where(i < 0, i + n, i)

    def forward(a):
        return jax.lax.dynamic_index_in_dim(a, at, d, keepdims=False)

    def inverse(base, value):
        return jax.lax.dynamic_update_index_in_dim(base, value.astype(base.dtype), at, d)

    size, stride = list(x.shape), list(x.stride())
    del size[d], stride[d]
    return _traced_view(x, aten.select.int, forward, inverse, size, stride, position * x.stride()[d])


def _traced_view(x, func, forward, inverse, size, stride, offset):
    """A view of ``x`` through ``forward`` / ``inverse`` at a traced position; ``offset``: the
    trace's value's, from ``x``'s own (its metadata only, see ``ViewStep.traced_offset``)."""
    step = ViewStep(forward, inverse, func, traced_offset=True)
    meta = (tuple(size), tuple(stride), x.storage_offset() + offset, x.dtype)
    return _make_view(x, step, forward(x._value()), meta)


def _traced_slice(x, dim=0, start=None, end=None, step=1):
    """``x[..., start:end]`` where a bound is a traced number of the program's inputs and the
    length is the same for every value (``x[t:t + k]``, ``x.narrow(0, t, k)``): a view whose
    step is a dynamic slice. The length and the bounds being inside ``x`` are guards (another
    length, or a bound torch would clamp, retraces); other slices stop the trace, and the
    numbers they read stay static."""
    d = _reg.canonical_dim(dim, x.dim())
    n = x.shape[d]
    bounds = [start, end]
    hints = [b.node.hint if _sym.is_traced_number(b) else b for b in bounds]
    if step != 1 or _sym.GUARDS is None or any(h is None for h in hints) or not 0 <= hints[0] <= hints[1] <= n:
        raise OpError("torch2jax: a slice with traced bounds needs both bounds, step 1 and bounds inside the tensor")
    replays = [b.node.replay if _sym.is_traced_number(b) else (lambda values, b=b: b) for b in bounds]
    length = hints[1] - hints[0]
    inputs = frozenset().union(*(b.node.inputs for b in bounds if _sym.is_traced_number(b)))

    def holds(values):
        first, last = replays[0](values), replays[1](values)
        return last - first == length and 0 <= first and last <= n

    _sym.GUARDS.append(_sym.Guard(holds, bool, True, inputs))
    at = jax.numpy.asarray(_sym.value_of(start) if _sym.is_traced_number(start) else start)

    def forward(a):
        return jax.lax.dynamic_slice_in_dim(a, at, length, d)

    def inverse(base, value):
        return jax.lax.dynamic_update_slice_in_dim(base, value.astype(base.dtype), at, d)

    size = list(x.shape)
    size[d] = length
    return _traced_view(x, aten.slice.Tensor, forward, inverse, size, x.stride(), hints[0] * x.stride()[d])


def _static_key(func, rest, kwargs):
    """Hashable key of a view op with arguments ``rest`` and ``kwargs``, or None if one is an array."""
    arrays, key = [], [func]
    try:
        _key(rest, arrays, key)
        if kwargs:
            _key(list(kwargs.values()), arrays, key)
            key.append(tuple(kwargs))
    except _NotStatic:
        return None
    return None if arrays else tuple(key)


def _apply_forward(forward, rest, kwargs, a):
    return forward(a, *rest, **kwargs)


def _apply_inverse(inverse, rest, kwargs, base, value):
    return inverse(base, value, *rest, **kwargs)


def _apply_compiled_forward(compiled, rest, kwargs, a):
    return compiled((a, *rest), kwargs)


def _apply_compiled_inverse(compiled, rest, kwargs, base, value):
    return compiled((base, value, *rest), kwargs)


def _pick(forward, i, rest, kwargs):
    return lambda a: forward(a, *rest, **kwargs)[i]


def _pick_inverse(inverse, i, rest, kwargs):
    return lambda base, value: inverse(base, value, i, *rest, **kwargs)


def strided_indices(size, stride, offset):
    """Flat storage indices of every element of an as_strided view (a NumPy array)."""
    idx = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    # (int32 where they fit: JAX takes them with or without 64-bit mode, as a view is read outside it)
    return idx.astype(np.int32) if idx.size and idx.max() < 2**31 else idx


def _generic_view_handler(func, args, kwargs):
    """Any view op: torch's meta kernel says where the view's elements lie in storage."""
    x = args[0]
    if func is aten.as_strided.default:
        for watch in _tensor.storage_watchers:
            watch(x)
    meta = _view_meta(func, x, args[1:], kwargs)
    metas = meta if isinstance(meta, list) else [meta]
    if any(m[3] != x.dtype for m in metas) or any(s.forward is None or s.traced_offset for s in x._t2j_view):
        raise OpError(f"torch2jax: view op {func} has no lowering for this input")
    # a view of the storage's elements, conjugated or negated as the views ``x`` comes through are
    conj = sum(step.name is aten._conj.default for step in x._t2j_view) % 2
    neg = sum(step.name is aten._neg_view.default for step in x._t2j_view) % 2
    storage = x._t2j_storage
    head = (_tensor.DETACHED,) if _tensor.DETACHED in x._t2j_view else ()
    if any(step.name in _REINTERPRETING for step in x._t2j_view):
        head += (_storage_as_step(x.dtype),)  # (strides and offset count elements of x's dtype)
    outs = []
    for size, stride, offset, dtype in metas:
        _check_in_storage(x, size, stride, offset, dtype)
        idx = strided_indices(size, stride, offset)
        step = ViewStep(
            functools.partial(_gather_flat, idx, conj=conj, neg=neg),
            functools.partial(_scatter_flat, idx, conj=conj, neg=neg),
            func,
            repeats=np.unique(idx).size < idx.size,
        )
        chain = head + (step,)
        value = storage.array
        for s in chain:
            value = s.forward(value)
        outs.append(Tensor(storage, chain, value=value, size=size, stride=stride, offset=offset, dtype=dtype))
    return outs if isinstance(meta, list) else outs[0]


def _check_in_storage(x, size, stride, offset, dtype):
    """torch's bounds check of a view's elements against its storage (meta tensors skip it)."""
    if 0 in size:
        return
    needed = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    have = _storage_numel(x)
    if needed > have:
        item = dtype.itemsize
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and itemsize {item} "
            f"requiring a storage size of {needed * item} are out of bounds for storage of size {have * item}"
        )


_REINTERPRETING = frozenset({aten.view.dtype, aten.view_as_real.default, aten.view_as_complex.default})


def _lazy_values(a, conj, neg):
    a = a.conj() if conj else a
    return -a if neg else a


def _storage_as_step(dtype):
    """A step from a storage's array to its bytes as a flat array of ``dtype``: where a
    dtype view (``x.view(torch.int32)``) is restrided, its strides count those elements."""
    from .ops.shape import storage_as, storage_as_back

    dtype = _dt.to_jax(dtype)
    return ViewStep(functools.partial(storage_as, dtype), storage_as_back, aten.view.dtype)


def _gather_flat(idx, base, conj=False, neg=False):
    return _lazy_values(base.reshape(-1)[idx], conj, neg)


def _scatter_flat(idx, base, value, conj=False, neg=False):
    value = _lazy_values(value, conj, neg)
    return base.reshape(-1).at[idx.reshape(-1)].set(value.reshape(-1)).reshape(base.shape)


# ---------------------------------------------------------------------------
# mutation: in-place ops and out= arguments
# ---------------------------------------------------------------------------


def _mutated(schema):
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


# Ops that refuse any overlap between the tensor they write and their inputs, even a
# full one (torch's at::assert_no_overlap): they read their inputs while writing.
_NO_OVERLAP = {
    "index_copy", "index_copy_", "index_add", "index_add_", "index_reduce", "index_reduce_", "index_put_",
    "_index_put_impl_", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "put_", "gather", "index_select", "take", "cat", "stack", "masked_select", "kthvalue", "linalg_cross",
}
# Beside the pointwise ops (torch's TensorIterator), these refuse a partial overlap only
# (at::assert_no_partial_overlap): writing a tensor onto itself is fine.
_NO_PARTIAL_OVERLAP = {"copy_", "where", "cumsum", "cumsum_", "cumprod", "cumprod_", "sort"}
# ... and these overloads, where others of the name do not check (``max(x, out=)`` lets its
# value overlap the input; addr's kernel is a TensorIterator over self, vec1 and vec2)
_NO_PARTIAL_OVERLAP_OPS = {
    aten.max.dim_max, aten.min.dim_min, aten.median.dim_values, aten.nanmedian.dim_values, aten.mode.values,
    aten.topk.values, aten.addr.out, aten.addr_.default,
}
# The written tensor itself may not show one element twice (at::assert_no_internal_overlap): the
# ops above, the pointwise ones, and these; but not the ones after them, which torch lets write
# an expanded tensor.
_NO_INTERNAL_OVERLAP = {
    aten.fill_.Tensor, aten.masked_scatter_.default, aten.normal_.default, aten.uniform_.default,
    aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.random_.default, aten.random_.to, getattr(aten.random_, "from"),
    aten.exponential_.default, aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default,
    aten.mm.out, aten.addmm.out, aten.baddbmm.out, aten.addbmm.out, aten.addmv.out,
}
# (threshold_ and masked_fill_ write an expanded tensor in torch; conj_physical_ and nan_to_num_ of a tensor
# they leave as it is write nothing, and of any other refuse through their copy_)
_INTERNAL_OVERLAP_ALLOWED = {"index_put_", "_index_put_impl_", "threshold_", "masked_fill_", "conj_physical_",
                             "nan_to_num_"}
# TensorIterator ops that torch does not tag pointwise (beside the in-place variants of tagged ops,
# `_pointwise`): the pointwise checks apply
_UNTAGGED_POINTWISE = {"floor_divide", "floor_divide_", "hardswish", "hardswish_"}
# in-place ops whose kernels refuse only a written tensor that shows an element twice
_NO_INTERNAL_OVERLAP_NAMES = {"renorm_", "addmm_", "addbmm_", "rrelu_with_noise_"}
# Arguments torch turns into a new tensor before the kernel that writes (ldexp: ``mul_out(out, self,
# pow(2, other))``): their overlap with the written tensor is not checked
_READ_AS_A_COPY = {"ldexp_": {"other"}, "ldexp": {"other"}}

_OVERLAP_MESSAGE = (
    "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory "
    "location. Please clone() the tensor before performing the operation."
)
INTERNAL_OVERLAP_MESSAGE = (
    "unsupported operation: more than one element of the written-to tensor refers to a single memory location. "
    "Please clone() the tensor before performing the operation."
)


def _checking_overlap(func, handler):
    """``handler`` behind torch's memory-overlap checks, for ops that write a tensor.

    A jax-device op computes its result before it writes, so an overlap torch refuses
    (``x[1:] = x[:-1]``, ``x[mask] = x[:5]``) would silently give the answer of a cloned
    input; torch's error is the specification (its result would depend on the order its
    kernel visits elements).
    """
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        return handler
    schema = func._schema
    name = schema.name.split("::")[1]
    full = name in _NO_OVERLAP
    inputs = full or name in _NO_PARTIAL_OVERLAP or func in _NO_PARTIAL_OVERLAP_OPS or _pointwise(func, name)
    internal = (inputs or func in _NO_INTERNAL_OVERLAP or name in _NO_INTERNAL_OVERLAP_NAMES) and \
        name not in _INTERNAL_OVERLAP_ALLOWED
    if not (inputs or internal):
        return handler
    mutated = _mutated(schema)
    if not mutated:
        return handler
    written = [(i, schema.arguments[i].name) for i in mutated]
    read = [
        (i, a.name, isinstance(a.type, torch.ListType))
        for i, a in enumerate(schema.arguments)
        if inputs and i not in mutated and "Tensor" in str(a.type) and a.name not in _READ_AS_A_COPY.get(name, ())
    ]

    def checked(func, args, kwargs):
        n = len(args)
        for i, name in written:
            w = args[i] if i < n else kwargs.get(name)
            storage = getattr(w, "_t2j_storage", None)
            if storage is None:
                continue
            # a base tensor is dense; only a view can repeat elements (expand, as_strided)
            if internal and w._t2j_view and w.numel() and \
                    any(st == 0 and sz > 1 for sz, st in zip(w.shape, w.stride())):
                raise TorchRuntimeError(INTERNAL_OVERLAP_MESSAGE)
            for j, rname, is_list in read:
                a = args[j] if j < n else kwargs.get(rname)
                for b in (a or ()) if is_list else (a,):
                    if getattr(b, "_t2j_storage", None) is storage:
                        status = _overlap(w, b)
                        if status == "partial" or (full and status == "full"):
                            raise TorchRuntimeError(_OVERLAP_MESSAGE)
        return handler(func, args, kwargs)

    return checked


def _pointwise(func, name) -> bool:
    """Whether torch runs ``func`` as an elementwise TensorIterator op: tagged pointwise, in
    `_UNTAGGED_POINTWISE`, or the in-place variant of a tagged op (``abs_``, ``eq_``: torch tags
    only ``abs`` and ``eq.Tensor``)."""
    if torch.Tag.pointwise in func.tags or name in _UNTAGGED_POINTWISE:
        return True
    if not name.endswith("_"):
        return False
    functional = functional_variant(func)
    return functional is not None and torch.Tag.pointwise in functional.tags


def _overlap(a, b):
    """How tensors ``a`` and ``b`` of one storage overlap, as torch's get_overlap_status
    decides it: "full" (same elements, same strides), "partial", or None (disjoint, or
    too hard to tell: one of them has gaps or repeats)."""
    if a is b:
        return "full"
    if a.numel() == 0 or b.numel() == 0:
        return None
    dense = _prims_common.is_non_overlapping_and_dense_or_false
    if not (dense(a) and dense(b)):
        return None
    a_begin = a.storage_offset() * a.element_size()
    b_begin = b.storage_offset() * b.element_size()
    a_end = a_begin + a.numel() * a.element_size()
    b_end = b_begin + b.numel() * b.element_size()
    if (a_begin, a_end) == (b_begin, b_end):
        return "full" if a.stride() == b.stride() else "partial"
    return "partial" if a_begin < b_end and b_begin < a_end else None


@functools.lru_cache(maxsize=None)
def functional_variant(func):
    """The functional overload computing what mutating ``func`` writes, or None.

    ``add_.Tensor -> add.Tensor``, ``normal_ -> normal_functional``,
    ``sum.IntList_out -> sum.dim_IntList``: matched on the argument types.
    """
    schema = func._schema
    mutated = _mutated(schema)
    name = schema.name.split("::")[1]
    ns = getattr(torch.ops, func.namespace)
    is_out = bool(mutated) and all(schema.arguments[i].kwarg_only for i in mutated)
    if is_out:
        candidates = [name]
        want = [str(a.type) for i, a in enumerate(schema.arguments) if i not in mutated]
    elif name.startswith("__i") and mutated == [0]:  # (``x <<= 1``: __ilshift__ -> __lshift__)
        candidates = ["__" + name[3:]]
        want = [str(a.type) for a in schema.arguments]
    elif name.endswith("_") and mutated == [0]:
        candidates = [name[:-1], name[:-1] + "_functional"]
        want = [str(a.type) for a in schema.arguments]
    else:
        return None
    n_out = len(mutated)
    overloads = []
    for cand in candidates:
        packet = getattr(ns, cand, None)
        if packet is not None:
            overloads += [getattr(packet, name) for name in packet.overloads()]
    overloads = [op for op in overloads if not op._schema.is_mutable and len(op._schema.returns) >= n_out]
    for op in overloads:
        if [str(a.type) for a in op._schema.arguments] == want:
            return op
    # Factories' out= overloads lack the dtype/layout/device keywords: match positionally.
    positional = [str(a.type) for i, a in enumerate(schema.arguments) if i not in mutated and not a.kwarg_only]
    for op in overloads:
        if [str(a.type) for a in op._schema.arguments if not a.kwarg_only] == positional:
            return op
    return None


def _omitted_defaults(func, functional):
    """What torch leaves out of a call of mutating ``func`` that ``functional`` needs.

    torch drops trailing arguments equal to their defaults before
    ``__torch_dispatch__``; when the functional variant has no such default
    (``bernoulli_.float`` has ``p=0.5``, ``bernoulli.p`` has none) they are put back.
    Returns the defaults of the leading positional arguments to fill up to
    (empty if none is needed) and the ``{name: default}`` of keyword-only ones.
    """
    mutated = _mutated(func._schema)
    own = [a for i, a in enumerate(func._schema.arguments) if i not in mutated or not a.kwarg_only]
    theirs = functional._schema.arguments
    keywords = {a.name: a for a in theirs if a.kwarg_only}
    n_positional, by_name = 0, {}
    for i, a in enumerate(own):
        if not a.has_default_value():
            continue
        other = keywords.get(a.name) if a.kwarg_only else (theirs[i] if i < len(theirs) else None)
        if other is None or (other.has_default_value() and other.default_value == a.default_value):
            continue
        if a.kwarg_only:
            by_name[a.name] = a.default_value
        else:
            n_positional = i + 1
    positional = [a.default_value if a.has_default_value() else None for a in own[:n_positional]]
    return positional, by_name


_DTYPE_FROM_OUT = {"sum", "prod", "cumsum", "cumprod", "mean", "nanmean"}
_INEXACT_FROM_OUT = {"mean", "nanmean"}  # only from a floating or complex input into such an out


def inexact(t) -> bool:
    """Whether ``t`` is a floating-point or complex tensor."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _mutation_handler(func, functional):
    schema = func._schema
    mutated = _mutated(schema)
    names = [schema.arguments[i].name for i in mutated]
    is_out = schema.arguments[mutated[0]].kwarg_only
    positional, by_name = _omitted_defaults(func, functional)
    pointwise = torch.Tag.pointwise in func.tags or func is aten.copy_.default
    # out= overloads of factories and of these reductions compute in out's dtype when no dtype is
    # given, as torch's (zeros(2, out=long_tensor) makes integers; cumsum(floats, out=ints) sums them
    # truncated); the others compute in their own dtype and cast (or refuse to) when writing
    takes_dtype = any(a.name == "dtype" and a.kwarg_only for a in functional._schema.arguments)
    factory = not any("Tensor" in str(a.type) for a in functional._schema.arguments)
    op_name = schema.name.split("::")[1]
    dtype_from_out = is_out and len(mutated) == 1 and takes_dtype and (factory or op_name in _DTYPE_FROM_OUT)
    # bernoulli(p, out=x) is x.bernoulli_(p): its 0s and 1s go into out of any dtype
    cast_into_out = is_out and op_name == "bernoulli"
    resize = ("quietly" if op_name in _RESIZES_QUIETLY else True) if is_out or op_name in _RESIZES_SELF else False

    def run(func, args, kwargs):
        if len(args) < len(positional):
            args = (*args, *positional[len(args):])
        if by_name:
            kwargs = {**by_name, **kwargs}
        from_out = False
        if is_out:
            targets = [kwargs[n] for n in names]
            fkwargs = {k: v for k, v in kwargs.items() if k not in names}
            if dtype_from_out and fkwargs.get("dtype") is None and isinstance(targets[0], torch.Tensor) and (
                    op_name not in _INEXACT_FROM_OUT or all(inexact(t) for t in (targets[0], args[0]))):
                fkwargs["dtype"] = targets[0].dtype
                from_out = True
        else:
            targets, fkwargs = [args[0]], kwargs

        def compute():
            values = _compute(functional, args, fkwargs)
            return values if isinstance(values, (list, tuple)) else (values,)

        values = compute()
        if is_out:
            # computed in the out's dtype, or cast into it: the input's dtype is the one it may refuse
            given = [_dt.to_jax(args[0].dtype)] * len(targets) if (from_out or cast_into_out) and \
                isinstance(args[0], torch.Tensor) else [v.dtype for v in values]
            _check_out_dtypes(func, args, kwargs, targets, given)
        if cast_into_out:
            values = [v.astype(_dt.to_jax(t.dtype)) for v, t in zip(values, targets)]
        rounds = _write_rounds(func, args, kwargs, targets, values) if pointwise else None
        if rounds is None:
            layouts = _resized_layouts(functional, args, fkwargs, targets, values) if is_out else [None] * len(values)
            for target, value, layout in zip(targets, values, layouts):
                write(target, value, func, resize=resize, strides=layout)
        else:
            _write_in_rounds(compute, targets[0], values[0], rounds, func)
        if is_out:
            return targets[0] if len(targets) == 1 else tuple(targets)
        return args[0]

    return run


# In-place ops whose CPU kernel writes self as an out= tensor: a broadcastable self is resized to the
# result's shape (torch.zeros(1).addbmm_(b1, b2) becomes (n, p))
_RESIZES_SELF = {"addbmm_"}
# out= ops whose CPU kernels resize ``out`` without torch's "was resized" warning (factories and random ops)
_RESIZES_QUIETLY = frozenset({"zeros", "ones", "full", "eye", "rand", "randint", "randperm", "linspace", "logspace",
                              "range", "normal", "bernoulli", "multinomial"})

# Stand-ins up to this many elements have the operands' own shapes; larger operands are
# checked on one-element stand-ins of their ranks.
_OUT_CHECK_ELEMENTS = 1 << 16


def _check_out_dtypes(func, args, kwargs, targets, dtypes):
    """torch's error where an ``out=`` tensor's dtype is not ``dtypes`` (the result's) and the
    op refuses to cast into it. Many kernels take only their result's exact dtype (``neg``,
    ``sort``, ``amax``, the linalg family: "Expected out tensor to have dtype float, but got
    double instead"), others any dtype the result casts to, and ``nansum`` computes in the
    out's dtype where ``sum`` does but not for integers; which is the kernel's own choice, so
    torch is asked: its meta kernel, then its CPU kernel on zero-filled stand-ins. Runs only
    when a dtype differs, so a matching ``out=`` costs nothing."""
    if all(not isinstance(t, torch.Tensor) or _dt.to_jax(t.dtype) == d for t, d in zip(targets, dtypes)):
        return
    try:
        margs, mkwargs = _tree_map_tensors(_to_meta, (args, kwargs))
        func(*margs, **mkwargs)
    except (RuntimeError, TypeError) as torch_error:
        # torch._refs' generic check of a safe cast (bernoulli's meta) is stricter than some CPU kernels
        message = str(torch_error)
        if type(torch_error) in (RuntimeError, TypeError) and "meta" not in message.lower() and \
                not message.startswith("Attempting to cast from"):
            raise _TORCH_ERRORS[type(torch_error)](message) from None
    except Exception:  # noqa: BLE001 - no meta kernel (NotImplementedError), or a data-dependent one
        pass
    n = sum(a.numel() for a in _pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
    # also "index_select(): self and result must have the same scalar type", "heaviside is not yet
    # implemented for complex tensors"
    _raise_stand_ins_dtype_error(func, args, kwargs, (*_DTYPE_WORDS, "type", "complex"),
                                 full_shapes=n <= _OUT_CHECK_ELEMENTS)


def _write_rounds(func, args, kwargs, targets, values):
    """The rounds in which torch's elementwise kernel writes an output view that shows
    one storage element in several places (an ``unfold`` with a step below its size, an
    overlapping ``as_strided``), or None for any other output.

    torch's CPU kernel visits such a view's elements one after another, each reading the
    memory the previous ones wrote: ``x.unfold(0, 3, 1).mul_(2)`` doubles an element once
    per window showing it, and ``copy_`` leaves the last value in its visiting order. Round
    ``k`` (a boolean mask over the view) holds the ``k``-th visit of every element, so
    applying the op round by round, each on the memory the earlier rounds left, is the
    same as visiting one by one."""
    target = targets[0]
    if len(targets) != 1 or not isinstance(target, Tensor) or not target._t2j_view or (
            tuple(values[0].shape) != tuple(target.shape)):
        return None
    shape, stride = tuple(target.shape), tuple(target.stride())
    if not _self_overlapping(shape, stride):
        return None
    operands = [stride]
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a is not target:
            operands.append(_broadcast_strides(tuple(a.shape), tuple(a.stride()), shape))
    return _visit_rounds(shape, stride, target.storage_offset(), tuple(operands))


@functools.lru_cache(maxsize=1024)
def _self_overlapping(shape, stride) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` shows some element more than once."""
    if 0 in shape:
        return False
    reach = 0
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size > 1):
        if st <= reach:
            return True
        reach += st * (size - 1)
    return False


def _broadcast_strides(shape, stride, out_shape):
    """Strides of a tensor of ``shape`` broadcast to ``out_shape`` (0 along broadcast dimensions)."""
    lead = len(out_shape) - len(shape)
    return tuple(
        0 if d < lead or shape[d - lead] != size else stride[d - lead] for d, size in enumerate(out_shape)
    )


def _iteration_order(shape, operands):
    """The dimensions from innermost to outermost as torch's TensorIterator orders them
    (reorder_dimensions): by the operands' strides, output first, where one decides, ties
    broken by the smaller size going inside."""

    def should_swap(d0, d1):
        for strides in operands:
            s0, s1 = strides[d0], strides[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(len(shape))))
    for i in range(1, len(shape)):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            verdict = should_swap(perm[d0], perm[d1])
            if verdict > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif verdict < 0:
                break
    return perm


@functools.lru_cache(maxsize=256)
def _visit_rounds(shape, stride, offset, operands):
    outer_first = list(reversed(_iteration_order(shape, operands)))
    visit = np.arange(math.prod(shape)).reshape([shape[d] for d in outer_first]).transpose(np.argsort(outer_first))
    position = offset + sum(np.arange(size).reshape([-1 if d == i else 1 for d in range(len(shape))]) * st
                            for i, (size, st) in enumerate(zip(shape, stride)))
    position = np.broadcast_to(position, shape).reshape(-1)
    by_visit = np.lexsort((visit.reshape(-1), position))
    sorted_position = position[by_visit]
    first = np.r_[True, sorted_position[1:] != sorted_position[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(first.size), 0))
    rank = np.empty_like(by_visit)
    rank[by_visit] = np.arange(by_visit.size) - start
    rank = rank.reshape(shape)
    return tuple(rank == k for k in range(int(rank.max()) + 1))


def _write_in_rounds(compute, target, value, rounds, func):
    """Write ``value`` (the op's result on the memory as it was) into ``target`` round by
    round (`_write_rounds`), ``compute()`` giving the op's results again on the memory each
    round left."""
    for k, mask in enumerate(rounds):
        if k:
            value = compute()[0]
        target._assign(jax.numpy.where(mask, _checked_value(target, value, func), target._value()))


def _inplace_view_handler(view_op):
    """``unsqueeze_``, ``t_``, ``as_strided_``...: the tensor becomes the view."""

    def run(func, args, kwargs):
        args[0]._rebind(dispatch(view_op, args, kwargs))
        return args[0]

    return run


def _resize_handler(func, args, kwargs):
    """``x.resize_(size)``: ``x`` becomes the contiguous ``size`` tensor at its storage offset,
    a view of its storage, which grows in place where it is too small (`_grow_storage`): the
    base and every other view of it keep seeing its elements."""
    x, size = args[0], tuple(args[1])
    memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        if tuple(x.shape) == size:
            return x
        strides = _tensor._contiguous_strides(size)
    else:  # channels_last: restrided even where the size stays
        strides = torch.empty(size, device="meta", memory_format=memory_format).stride()
    offset, numel = x.storage_offset(), math.prod(size)
    if offset + numel > x.untyped_storage().nbytes() // x.element_size():
        _grow_storage(x, offset + numel)
    x._rebind(dispatch(aten.as_strided.default, (x, size, strides, offset), {}))
    return x


def _grow_storage(x, numel):
    """Grow ``x``'s storage in place to ``numel`` elements of ``x``'s dtype, as torch reallocates
    the one StorageImpl a tensor and its views share: its array becomes a flat one, the old
    elements then new ones (which torch leaves uninitialized: `creation.uninitialized`), and the
    chains of the tensors on it start with a step back to the old array (`Tensor._t2j_view`)."""
    st = x._t2j_storage
    old = st.array
    n = -(-numel * x.element_size() // old.dtype.itemsize)
    flat = dispatch(aten.resize.default, (Tensor(st), (n,)), {})._value()  # (one compiled program)
    st.check_write(flat)
    st.array, st.version = flat, st.version + 1
    back = dispatch(aten.view.default, (dispatch(aten.slice.Tensor, (Tensor(st), 0, 0, old.size), {}), old.shape), {})
    st.grown += (back._t2j_view,)


def _strided_factory(run):
    """``empty_strided`` with the strides asked for where they lay out the tensor densely
    (torch's ``_to_copy`` to the jax device allocates the copy this way, and keeps
    a transposed or channels_last tensor's layout)."""

    def run_strided(func, args, kwargs):
        out = run(func, args, kwargs)
        return _laid_out(out, tuple(args[-1]))

    return run_strided


def _resize_as_handler(func, args, kwargs):
    return _resize_handler(aten.resize_.default, (args[0], args[1].shape), {})


def _set_handler(func, args, kwargs):
    """``x.set_(source)``: ``x`` becomes another tensor on ``source``'s storage (torch's
    parametrizations re-point a parameter at a new value this way); with an offset, size
    and stride, the view of that storage they describe."""
    if func is aten.set_.default:  # no source: an empty tensor on a storage of its own
        target = args[0]
        target._rebind(new_tensor(jax.numpy.zeros((0,), _dt.to_jax(target.dtype))))
        return target
    target, source, *layout = args
    if not isinstance(source, Tensor):
        raise OpError(f"torch2jax: {func} needs a jax-device source tensor, got {type(source).__name__} on "
                      f"{getattr(source, 'device', None)}")
    if layout or kwargs:
        names = ("storage_offset", "size", "stride")
        given = dict(zip(names, layout), **kwargs)
        stride = given.get("stride") or _tensor._contiguous_strides(tuple(given["size"]))
        view = dispatch(aten.as_strided.default, (source, given["size"], stride, given["storage_offset"]), {})
    else:
        view = dispatch(aten.alias.default, (source,), {})
    if view.dtype != target.dtype:
        raise TorchRuntimeError(f"Expected a source tensor of dtype {target.dtype}, but got {view.dtype}")
    target._rebind(view)
    return target


def _set_storage_handler(func, args, kwargs):
    """``x.set_(storage, offset, size, stride)`` with a jax tensor's storage (what
    ``x.set_(tensor, offset, size, stride)`` and ``x.storage()[i]`` turn into): ``x``
    becomes that view of the storage's values."""
    target, storage, *layout = args
    handle = getattr(storage, "_untyped_storage", storage)
    if not isinstance(handle, _tensor._StorageHandle):
        raise OpError(
            f"torch2jax: {func}: the storage is on {handle.device}, not the jax device; move its tensor with "
            ".to('jax') and pass that tensor"
        )
    whole = Tensor(handle._t2j_storage)
    if whole.dtype != target.dtype:
        raise OpError(
            f"torch2jax: {func}: the storage holds {whole.dtype} values and the tensor is {target.dtype}; "
            "set_ to a tensor of the storage's dtype, then .view(dtype)"
        )
    flat = whole.reshape(-1) if whole.dim() != 1 else whole
    names = ("storage_offset", "size", "stride")
    given = dict(zip(names, layout), **kwargs)
    size = tuple(given.get("size", (flat.numel(),)))
    stride = given.get("stride") or _tensor._contiguous_strides(size)
    target._rebind(dispatch(aten.as_strided.default, (flat, size, stride, given.get("storage_offset", 0)), {}))
    return target


def _is_set_to_handler(func, args, kwargs):
    """Whether two tensors are the same view of one storage (torch compares storage, offset, size, stride)."""
    a, b = args
    return (
        isinstance(b, Tensor)
        and a._t2j_storage is b._t2j_storage
        and a.storage_offset() == b.storage_offset()
        and tuple(a.shape) == tuple(b.shape)
        and tuple(a.stride()) == tuple(b.stride())
    )


def _resized_layouts(functional, args, kwargs, targets, values) -> list:
    """Per ``out=`` tensor that the op resizes, the strides torch gives it: those of the result of
    the op's functional form (``torch.add(x.t(), 1, out=torch.empty(0))`` is transposed, as
    ``x.t() + 1``), from torch's meta kernel; None for the others, and where the meta kernel
    cannot say."""
    resized = [isinstance(t, Tensor) and tuple(t.shape) != tuple(v.shape) for t, v in zip(targets, values)]
    if not any(resized):
        return [None] * len(values)
    try:
        margs, mkwargs = _tree_map_tensors(_to_meta, (args, kwargs))
        results = functional(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, or a data-dependent one: contiguous
        return [None] * len(values)
    results = (results,) if isinstance(results, torch.Tensor) else tuple(results)
    return [tuple(m.stride()) if r and isinstance(m, torch.Tensor) else None for m, r in zip(results, resized)]


def write(target, value, func, resize=False, strides=None):
    """Write array ``value`` into tensor ``target`` as op ``func`` does (cast, shape checks). ``resize``:
    a target of another shape is resized to ``value``'s, with torch's warning where it had elements
    (``"quietly"``: without it), and laid out with ``strides`` where they are a dense layout."""
    if not isinstance(target, Tensor):
        if func is torch.ops.aten.copy_.default and target.device.type == "cpu":
            # cpu_tensor.copy_(jax_tensor), as from CUDA: a CPU model's load_state_dict of a jax checkpoint
            if isinstance(value, jax.core.Tracer):
                raise OpError("torch2jax: copy_ into a CPU tensor inside a traced function; copy after it returns")
            with torch.no_grad():
                target.copy_(torch_cpu(value))
            return
        raise OpError(f"torch2jax: {func} writes into a tensor on {target.device}; expected the jax device")
    if tuple(value.shape) != tuple(target.shape):
        if resize:
            value = _checked_value(target, value, func)
            if target.numel() and resize != "quietly":
                warnings.warn(
                    f"An output with one or more elements was resized since it had shape {list(target.shape)}, "
                    f"which does not match the required output shape {list(value.shape)}.",
                    stacklevel=5,
                )
            _resize_handler(aten.resize_.default, (target, value.shape), {})
            if strides is not None and strides != target.stride() and \
                    _tensor.dense_order(tuple(value.shape), strides) is not None:
                target._rebind(dispatch(aten.as_strided.default,
                                        (target, tuple(value.shape), strides, target.storage_offset()), {}))
            target._assign(value)
            return
        raise TorchRuntimeError(
            f"output with shape {list(target.shape)} doesn't match the broadcast shape {list(value.shape)}"
        )
    target._assign(_checked_value(target, value, func))


def _checked_value(target, value, func):
    """``value`` cast to ``target``'s dtype, where torch's in-place / ``out=`` casting allows it."""
    dtype = _dt.to_jax(target.dtype)
    if value.dtype != dtype:
        if not _dt.can_cast(value.dtype, dtype):
            raise TorchRuntimeError(
                f"result type {_reg.scalar_type_name(value.dtype)} can't be cast to the desired output type "
                f"{_reg.scalar_type_name(target.dtype)}"
            )
        value = value.astype(dtype)
    return value


# ---------------------------------------------------------------------------
# host fallback
# ---------------------------------------------------------------------------


def _host_handler(func, args, kwargs, which=""):
    if any(map(is_sparse_jax, _pytree.tree_leaves((args, kwargs)))):
        return sparse_run(func, args, kwargs)  # (a dense jax tensor with a sparse one: `sparse_mask`)
    _check_devices(func, args, kwargs)
    if _sparse_only(func):
        raise OpError(
            f"torch2jax: {func} reads a sparse layout, and this tensor is dense: a sparse tensor made inside a "
            "traced program (t2j.jit, jax.jit) is stored dense (its to_dense()), and torch has no kernel of this "
            "op for dense tensors. Use dense ops on it (a sum, a masked softmax), or make the sparse tensor outside")
    COUNTERS["host_fallbacks"] += 1
    mode = _env.config().fallback
    if mode == "error":
        raise OpError(
            f"torch2jax: {func} has no JAX lowering or decomposition{which}, and host fallback is disabled "
            f"(fallback='error')"
        )
    if mode == "warn" and func not in _warned:
        _warned.add(func)
        warnings.warn(
            f"torch2jax: {func} has no JAX lowering{which}; it runs on the host through torch (slow, "
            f"and a host round trip under jit)",
            stacklevel=4,
        )
    return _host_run(func, args, kwargs)


@functools.cache
def _sparse_only(func) -> bool:
    """Whether torch's kernels of ``func`` are for sparse layouts only (``_nnz``, ``_sparse_softmax``): the host
    fallback would fail on the dense CPU copy with a message blaming the CPU backend."""
    name, has = func.name(), torch._C._dispatch_has_kernel_for_dispatch_key
    return not any(has(name, key) for key in ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd")) \
        and any(has(name, key) for key in ("SparseCPU", "SparseCsrCPU"))


def _is_traced(tree):
    return any(isinstance(t, Tensor) and isinstance(t._value(), jax.core.Tracer) for t in _tensors_of(tree))


_BACKWARD_ERRORS = threading.local()


def defer_backward_error(func, args, kwargs, error):
    """Keep ``error`` (raised by ``func`` inside the autograd engine) for
    `raise_backward_error` and give the engine zeros shaped as ``func``'s result."""
    error.add_note(f"(raised by {func} in the backward pass)")
    _keep_backward_error(error)
    pending = _BACKWARD_ERRORS.errors
    try:
        margs, mkwargs = _tree_map_tensors(_to_meta, (args, kwargs))
        out = func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: shaped like the first tensor argument
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        returns = func._schema.returns
        if first is None or not returns or any(not isinstance(r.type, torch.TensorType) for r in returns):
            pending.remove(error)
            raise error from None
        out = [first] * len(returns) if len(returns) > 1 else first
    return _tree_map_tensors(lambda t: new_tensor(jax.numpy.zeros(tuple(t.shape), _dt.to_jax(t.dtype))), out)


def _keep_backward_error(error):
    pending = getattr(_BACKWARD_ERRORS, "errors", None)
    if pending is None:
        pending = _BACKWARD_ERRORS.errors = []
    pending.append(error)


def deferring_errors(hook, check=None, jax_tensor=False):
    """``hook`` (a backward hook: tensor, post-accumulate-grad, module) with an exception it
    raises on jax-device gradients (on any, None included, for the hook of a ``jax_tensor``)
    kept for `raise_backward_error` instead of raised, and so is the error
    ``check(hook, args, result)`` finds in what it returns (torch's own check of it, made by
    the engine or the module's hook machinery, would raise in the same place).

    torch's engine unwinds a Python hook's exception past the stream guard of a
    PrivateUse1 node, whose destructor calls back into Python with the error still set:
    the process aborts. Kept here, the hook changes nothing, the pass runs to its end,
    and ``backward()`` / ``autograd.grad`` raise the error as torch does on the CPU.
    """

    def on_jax(args) -> bool:
        return jax_tensor or any(
            isinstance(a, Tensor) or (isinstance(a, tuple) and any(isinstance(t, Tensor) for t in a)) for a in args)

    @functools.wraps(hook)
    def run(*args, **kwargs):
        try:
            result = hook(*args, **kwargs)
        except Exception as error:
            if not on_jax(args):
                raise
            _keep_backward_error(error)
            return None
        error = None if check is None or result is None else check(hook, args, result)
        if error is not None and on_jax(args):
            _keep_backward_error(error)
            return None
        return result

    return run


def tensor_hook_result(hook, args, result):
    """The error torch's engine raises for what a tensor hook returned in place of gradient
    ``args[0]``, if any."""
    if not isinstance(result, torch.Tensor):
        return TypeError(f"expected Variable, but hook returned '{type(result).__name__}'")
    value, name = args[0], getattr(hook, "__name__", type(hook).__name__)
    if value is None:
        return RuntimeError("can't replace a None gradient with a non-None value")
    if result.dtype != value.dtype:
        return RuntimeError(f"hook '{name}' has changed the type of value (was {value.type()} got {result.type()})")
    if result.shape != value.shape:
        return RuntimeError(f"hook '{name}' has changed the size of value")
    return None


def module_hook_result(what):
    """The check of a module's full backward hook (``what="grad_input"``) or backward pre-hook
    (``"grad_output"``): the number of gradients it returned, as `torch.utils.hooks.BackwardHook`."""
    hook_kind = "Backward hook" if what == "grad_input" else "Backward pre hook"

    def check(hook, args, result):
        if not hasattr(result, "__len__"):
            return TypeError(f"object of type '{type(result).__name__}' has no len()")
        if len(result) != len(args[1]):
            return RuntimeError(f"{hook_kind} returned an invalid number of {what}, got {len(result)}, but "
                                f"expected {len(args[1])}")
        return None

    return check


def unpacking_errors_deferred(unpack_hook):
    """A saved-tensors ``unpack_hook`` (``torch.autograd.graph.saved_tensors_hooks``, non-reentrant
    checkpointing's recomputation) whose exception during a backward pass is kept for
    `raise_backward_error` (see `deferring_errors`): it returns None instead, which the engine
    refuses with an error of its own, raised in its place when the pass returns."""

    @functools.wraps(unpack_hook)
    def unpack(packed):
        try:
            return unpack_hook(packed)
        except Exception as error:
            if not getattr(_BACKWARD_ERRORS, "depth", 0):
                raise
            _keep_backward_error(error)
            return None

    return unpack


@contextlib.contextmanager
def backward_pass():
    """The block runs a backward pass (the engine's entry point): the errors kept in it are raised
    when it ends, in place of the engine's own."""
    _BACKWARD_ERRORS.depth = getattr(_BACKWARD_ERRORS, "depth", 0) + 1
    try:
        yield
    finally:
        _BACKWARD_ERRORS.depth -= 1
        raise_backward_error()


def raise_backward_error():
    """Raise the first error kept by `defer_backward_error` since the last call, if any."""
    pending = getattr(_BACKWARD_ERRORS, "errors", None)
    if pending:
        _BACKWARD_ERRORS.errors = []
        error = pending[0]
        error.__suppress_context__ = True  # (the engine's error for what the deferring hook returned)
        raise error


def _to_meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _to_cpu(t):
    """A CPU copy of jax tensor ``t`` with its strides where they describe a dense layout
    (a transposed or channels_last tensor stays one: ``.cpu()`` preserves the format)."""
    if not isinstance(t, Tensor):
        return t
    host = torch_cpu(t._value())
    if t._t2j_view and t.dim() > 1 and not t.is_contiguous() and _prims_common.is_non_overlapping_and_dense_or_false(t):
        host = torch.empty_strided(t.shape, t.stride(), dtype=host.dtype).copy_(host)
    return host


def _cpu_kwargs(kwargs):
    if "device" in kwargs and kwargs["device"] is not None and torch.device(kwargs["device"]).type == DEVICE.type:
        return {**kwargs, "device": torch.device("cpu")}
    return kwargs


def _host_run(func, args, kwargs):
    """Run ``func`` with torch on CPU; results come back to the jax device."""
    foreign = _is_foreign_device(kwargs)
    if foreign and torch.device(kwargs["device"]).type == "meta":
        # (forward-mode AD makes meta stand-ins of its operands): only shapes and dtypes, also traced
        return func(*_tree_map_tensors(_to_meta, args), **_tree_map_tensors(_to_meta, kwargs))
    if _is_traced((args, kwargs)):
        if foreign:
            raise ValueNeeded(
                f"torch2jax: {func} cannot produce a CPU tensor inside a traced function (t2j.jit, jax.jit): "
                "its values are not known until the program runs (.cpu(), .numpy(), .tolist(), .to('cpu') of a "
                "traced tensor). Keep it on the jax device, or return it and move it after the call")
        return _host_callback(func, args, kwargs)
    cargs, ckwargs = _tree_map_tensors(_to_cpu, (args, _cpu_kwargs(kwargs)))
    out = func(*cargs, **ckwargs)
    for i in _mutated(func._schema) if isinstance(func, torch._ops.OpOverload) else ():
        a = func._schema.arguments[i]
        target = args[i] if i < len(args) else kwargs.get(a.name)
        source = cargs[i] if i < len(cargs) else ckwargs.get(a.name)
        targets, sources = (target, source) if isinstance(target, (list, tuple)) else ([target], [source])
        for t, src in zip(targets, sources):  # a mutated Tensor[] (fused optimizers) writes every element
            if isinstance(t, Tensor):
                t._assign(jax_array(src))
    if foreign:
        return out
    return _back_to_jax(out, args, kwargs, cargs, ckwargs)


def _back_to_jax(out, args, kwargs, cargs, ckwargs):
    # Outputs that alias a mutated input are that input itself, as in torch.
    aliases = {id(c): a for c, a in zip(cargs, args)}
    aliases.update({id(ckwargs[k]): v for k, v in kwargs.items() if k in ckwargs})

    def back(o):
        if id(o) in aliases and isinstance(aliases[id(o)], Tensor):
            return aliases[id(o)]
        return from_torch_cpu(o) if o.device.type == "cpu" else o

    return _tree_map_tensors(back, out)


def _host_callback(func, args, kwargs):
    if isinstance(func, torch._ops.OpOverload) and func._schema.is_mutable:
        raise OpError(f"torch2jax: {func} mutates its input and has no lowering; it cannot run under jit")
    margs, mkwargs = _tree_map_tensors(_to_meta, (args, kwargs))
    try:
        mout = func(*margs, **mkwargs)
    except Exception as e:
        raise OpError(
            f"torch2jax: {func} has no JAX lowering and its output shape is not known before it runs "
            f"({type(e).__name__}: {e}); it cannot run under jit"
        ) from e
    leaves, treedef = jax.tree_util.tree_flatten(mout, is_leaf=lambda t: isinstance(t, torch.Tensor))
    result_shapes = [jax.ShapeDtypeStruct(tuple(t.shape), _dt.to_jax(t.dtype)) for t in leaves]
    tensors = _tensors_of((args, kwargs))
    jax_inputs = [t._value() if isinstance(t, Tensor) else jax_array(t) for t in tensors]

    def host_inputs(arrays, differentiable=()):
        it = iter(arrays)

        def make(t):
            host = torch_cpu(np.asarray(next(it)))
            return host.requires_grad_() if id(t) in differentiable else host

        return _tree_map_tensors(make, (args, _cpu_kwargs(kwargs)))

    def host_outputs(out):
        return jax.tree_util.tree_flatten(out, is_leaf=lambda t: isinstance(t, torch.Tensor))[0]

    def callback(*arrays):
        cargs, ckwargs = host_inputs(arrays)
        return [np.asarray(jax_array(r)) for r in host_outputs(func(*cargs, **ckwargs))]

    inexact = [jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in jax_inputs]
    inexact_outs = [jax.numpy.issubdtype(s.dtype, jax.numpy.inexact) for s in result_shapes]

    def host_vjp(*arrays_and_cotangents):
        # torch's own backward of the op, on the CPU: the gradients of its floating inputs
        arrays, cotangents = arrays_and_cotangents[:len(tensors)], arrays_and_cotangents[len(tensors):]
        differentiable = {id(t) for t, f in zip(tensors, inexact) if f}
        cargs, ckwargs = host_inputs(arrays, differentiable)
        leaves = [t for t in _tensors_of((cargs, ckwargs)) if t.requires_grad]
        with torch.enable_grad():  # (the callback may run inside torch's backward pass)
            outs = [o for o, f in zip(host_outputs(func(*cargs, **ckwargs)), inexact_outs) if f]
        pairs = [(o, torch_cpu(np.asarray(c))) for o, c in zip(outs, cotangents) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs],
                                    allow_unused=True) if pairs else [None] * len(leaves)
        return [np.zeros(x.shape, x.dtype) if g is None else np.asarray(g.detach(), dtype=x.dtype)
                for g, x in zip(grads, (a for a, f in zip(arrays, inexact) if f))]

    @jax.custom_vjp
    def run(*arrays):
        return jax.pure_callback(callback, result_shapes, *arrays)

    def run_fwd(*arrays):
        return run(*arrays), arrays

    def run_bwd(arrays, cotangents):
        kept = [c for c, f in zip(cotangents, inexact_outs) if f]
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a, f in zip(arrays, inexact) if f]
        grads = iter(jax.pure_callback(host_vjp, shapes, *arrays, *kept) if shapes else ())
        return tuple(next(grads) if f else None for f in inexact)

    run.defvjp(run_fwd, run_bwd)
    outs = run(*jax_inputs)
    return jax.tree_util.tree_unflatten(treedef, [new_tensor(o) for o in outs])


def _tensors_of(tree) -> list:
    found = []
    _tree_map_tensors(lambda t: found.append(t) or t, tree)
    return found


# ---------------------------------------------------------------------------
# coverage report
# ---------------------------------------------------------------------------


def path_of(func) -> str:
    """Which resolution path ``func`` takes: lowering, functional, decomposition or fallback."""
    if func not in _PATHS:
        _resolve(func)
    return _PATHS[func]


@contextlib.contextmanager
def record_ops():
    """Collect every op dispatched to the jax device inside the block into a list
    (an enclosing `record_ops` block gets them too)."""
    global _coverage_log
    previous, _coverage_log = _coverage_log, []
    log = _coverage_log
    try:
        yield log
    finally:
        _coverage_log = previous
        if previous is not None:
            previous.extend(log)


def coverage(fn, *args, **kwargs) -> dict:
    """Run ``fn(*args, **kwargs)`` once and report, for every ATen op that reached the
    jax device, the path it took.

    >>> t2j.coverage(model, x)
    {'aten.addmm.default': 'lowering', 'aten.gelu.default': 'lowering', ...}
    """
    with record_ops() as log:
        fn(*args, **kwargs)
    return {str(op): path_of(op) for op in dict.fromkeys(log)}




if os.environ.get("TORCH2JAX_LOG"):
    from . import debug as _debug

    _debug.set_log_from_environment()
