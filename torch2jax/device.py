"""The "jax" device: PyTorch's PrivateUse1 backend, renamed and routed to torch2jax.

Factory ops on ``device="jax"`` (``torch.randn(3, device="jax")``) and copies
from CPU (``t.to("jax")``, ``module.to("jax")``) reach PrivateUse1 kernels;
a boxed fallback sends them all to `torch2jax.dispatch.dispatch`. Tensors
already on the device dispatch through `torch2jax.Tensor.__torch_dispatch__`.
"""

from __future__ import annotations

import contextlib

import functools
import inspect
import os
import sys

import torch
import torch.utils.backend_registration as _backend

from . import env as _env

NAME = "jax"


class _DeviceModule:
    """What torch asks a backend module for (``torch.jax`` after registration)."""

    # torch.utils.checkpoint stashes and restores a backend's RNG state (so that a
    # recomputed forward draws the same dropout masks) only when this is set
    _initialized = True

    @staticmethod
    def device(index):
        """``with torch.jax.device(i):`` — the jax device is one device: nothing to switch."""
        return contextlib.nullcontext()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed(seed: int) -> None:
        _env.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        _env.manual_seed(seed)

    @staticmethod
    def seed() -> None:
        """Seed the jax device's generator with a non-deterministic number (the CPU's is untouched)."""
        _env.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    @staticmethod
    def seed_all() -> None:
        _DeviceModule.seed()

    @staticmethod
    def initial_seed() -> int:
        return _env.default_rng.initial_seed

    @staticmethod
    def get_rng_state(device="jax") -> torch.Tensor:
        return _env.rng_state_bytes()

    @staticmethod
    def set_rng_state(state, device="jax") -> None:
        _env.set_rng_state_bytes(state)

    @staticmethod
    def get_rng_state_all() -> list:
        return [_env.rng_state_bytes()]

    @staticmethod
    def set_rng_state_all(states) -> None:
        (state,) = states
        _env.set_rng_state_bytes(state)

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16, torch.float32]

    @staticmethod
    def synchronize(device=None) -> None:
        """Wait for every computation whose result is alive (JAX dispatches asynchronously)."""
        import jax

        jax.block_until_ready(jax.live_arrays())

    @staticmethod
    def memory_stats(device=None) -> dict:
        """The JAX device's allocator statistics (empty where the backend keeps none, as on CPU)."""
        import jax

        return jax.devices()[0].memory_stats() or {}

    @staticmethod
    def memory_allocated(device=None) -> int:
        """Bytes held by live arrays: the allocator's count, else the arrays' own sizes."""
        import jax

        stats = _DeviceModule.memory_stats()
        if "bytes_in_use" in stats:
            return int(stats["bytes_in_use"])
        return sum(a.nbytes for a in jax.live_arrays())

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        stats = _DeviceModule.memory_stats()
        return int(stats.get("peak_bytes_in_use", _DeviceModule.memory_allocated()))

    @staticmethod
    def empty_cache() -> None:
        """Nothing to release: JAX frees an array's buffer when the array is collected."""


def _accelerator_api(name, original):
    """``torch.accelerator.<name>``, answered by the jax device module when the current
    accelerator is the jax device (torch's own would ask for a C++ allocator or stream
    the Python backend does not have)."""

    @functools.wraps(original)
    def api(*args, **kwargs):
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None and accelerator.type == NAME:
            return getattr(_DeviceModule, name)(*args)
        return original(*args, **kwargs)

    return api


def _to_dlpack(original):
    """``torch.to_dlpack`` that exports a jax-device tensor's jax.Array (torch's would
    describe the wrapper tensor, which owns no memory)."""

    @functools.wraps(original)
    def to_dlpack(tensor):
        if tensor.device.type == NAME:
            return tensor.__dlpack__()
        return original(tensor)

    return to_dlpack


def _fallback(op, *args, **kwargs):
    from .dispatch import dispatch

    return dispatch(op, args, kwargs)


def _copy(dst, src, non_blocking=False):
    from .dispatch import dispatch

    return dispatch(torch.ops.aten.copy_.default, (dst, src, non_blocking), {})


def _set_to_tensor(target, source, storage_offset, size, stride=()):
    from .dispatch import dispatch

    return dispatch(torch.ops.aten.set_.source_Tensor_storage_offset, (target, source, storage_offset, size, stride), {})


def _written_to_out(name, op):
    """The ``out=`` overload ``op`` of a composite op as its functional overload and a write into
    ``out``: torch's composite kernel re-points its C++ result handle for a tensor subclass
    (``result = at::sum(...)`` under ``isTensorSubclassLike``), so ``out`` kept its old values."""

    def run(*args, out, **kwargs):
        from .dispatch import functional_variant
        from .ops.registry import scalar_type_name

        result = functional_variant(op)(*args, **kwargs)
        if not torch.can_cast(result.dtype, out.dtype):
            raise RuntimeError(f"{name}: Expected result to be safely castable from {scalar_type_name(result.dtype)} "
                               f"dtype, but got result with dtype {scalar_type_name(out.dtype)}")
        torch._refs._maybe_resize_out(out, result.shape)
        return out.copy_(result)

    return run


_libs = []


_dynamo_kept_out = False
# torch functions replaced by torch2jax's wrappers that send jax tensors its way (`wraps_torch_function`)
_TORCH_WRAPPERS: list = []


def keep_dynamo_out_of_jax() -> None:
    """Keep Dynamo out of JAX's and torch2jax's frames (once): a jax tensor under a
    backend other than torch2jax's then runs eagerly instead of Dynamo tracing the
    dispatcher (and breaking JAX). Where the code Dynamo compiles calls a torch function
    torch2jax wraps (`wraps_torch_function`), it traces the original."""
    global _dynamo_kept_out
    if not _dynamo_kept_out:
        import torch._dynamo

        for package in ("jax", "jaxlib", "torch2jax"):
            torch._dynamo.trace_rules.add(package)
        _dynamo_kept_out = True
        for wrapper, traced_on_jax in _TORCH_WRAPPERS:
            _original_in_graphs(wrapper, traced_on_jax)


def wraps_torch_function(wrapper, traced_on_jax: bool = False):
    """Register ``wrapper``, which replaced a torch function (``torch.cond``) and names it as
    its ``__wrapped__`` (`functools.wraps`). A Python function in a file Dynamo skips, it would
    be a graph break (an error under ``fullgraph=True``) wherever ``torch.compile`` meets it,
    also in code on other devices, where the original is traceable: Dynamo traces the original
    instead where no argument is a jax tensor, and, with ``traced_on_jax``, where the jax tensors
    are the fake tensors torch2jax's backend traces (`dynamo.trace_jax_tensors`). Returns ``wrapper``.

    >>> torch.cond = wraps_torch_function(_torch_cond(torch.cond), traced_on_jax=True)
    """
    _TORCH_WRAPPERS.append((wrapper, traced_on_jax))
    if _dynamo_kept_out:
        _original_in_graphs(wrapper, traced_on_jax)
    return wrapper


# Whether a value (or a tuple, list or dict of them) holds a jax tensor: an opaque object to Dynamo or, with
# ``fakes``, one of the fake tensors on the jax device Dynamo traces for torch2jax's backend
# (`dynamo.trace_jax_tensors`). Compiled from this source, so that it belongs to no file Dynamo skips:
# the code that replaces torch functions for jax tensors calls it where Dynamo traces.
_HOLDS_JAX_TENSOR = """
def holds_jax_tensor(x, fakes=True):
    if isinstance(x, jax_tensor) or fakes and isinstance(x, torch.Tensor) and x.device.type == "jax":
        return True
    if isinstance(x, (tuple, list)):
        return any(holds_jax_tensor(v, fakes) for v in x)
    if isinstance(x, dict):
        return any(holds_jax_tensor(v, fakes) for v in x.values())
    return False
"""


@functools.lru_cache(maxsize=None)
def holds_jax_tensor():
    """The `_HOLDS_JAX_TENSOR` function (made on first use: it names `torch2jax.Tensor`)."""
    from .tensor import Tensor

    namespace = {"torch": torch, "jax_tensor": Tensor}
    exec(compile(_HOLDS_JAX_TENSOR, "<torch2jax: holds_jax_tensor>", "exec"), namespace)  # noqa: S102
    return namespace["holds_jax_tensor"]


# What Dynamo traces for a wrapper, compiled as `_HOLDS_JAX_TENSOR` is: jax tensors (unless ``traced_on_jax``,
# also the fake ones) go to the wrapper, which runs eagerly (a graph break), as the function runs without
# Dynamo; other tensors to the original.
_SUBSTITUTE = """
def substitute(*args, **kwargs):
    if holds_jax_tensor((args, kwargs), not traced_on_jax):
        return wrapper(*args, **kwargs)
    return original(*args, **kwargs)
"""


def _original_in_graphs(wrapper, traced_on_jax: bool) -> None:
    import torch._dynamo

    def eagerly(*args, **kwargs):  # (a function of this file, which Dynamo skips: a graph break, then eager)
        return wrapper(*args, **kwargs)

    namespace = {"holds_jax_tensor": holds_jax_tensor(), "traced_on_jax": traced_on_jax, "wrapper": eagerly,
                 "original": wrapper.__wrapped__}
    exec(compile(_SUBSTITUTE, f"<torch2jax: {wrapper.__qualname__} in Dynamo>", "exec"), namespace)  # noqa: S102
    torch._dynamo.substitute_in_graph(wrapper, skip_signature_check=True)(namespace["substitute"])


def _keeping_dynamo_out_of_jax(compile):
    """``torch.compile`` that first calls `keep_dynamo_out_of_jax` (on importing torch2jax,
    every user would pay for importing Dynamo)."""

    @functools.wraps(compile)
    def compile_(*args, **kwargs):
        keep_dynamo_out_of_jax()
        return compile(*args, **kwargs)

    return compile_


def _swapping(method):
    """Wrap an ``nn.Module`` conversion so that moving to or from the jax device swaps
    each parameter in place (``torch.utils.swap_tensors``) instead of creating a new
    one: a weight shared by two submodules stays shared (GPT-2's tied embedding),
    and optimizers built before the move keep pointing at the module's parameters."""

    @functools.wraps(method)
    def convert(module, *args, **kwargs):
        if method.__name__ == "to":
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            involved = device is not None and (device.type == NAME or _has_jax_tensors(module))
        else:
            involved = _has_jax_tensors(module)
        if not involved or torch.__future__.get_swap_module_params_on_conversion():
            return method(module, *args, **kwargs)
        lazy = _take_uninitialized(module)
        kinds = _parameter_kinds(module)
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            try:
                return method(module, *args, **kwargs)
            except RuntimeError as e:
                if "Couldn't swap" not in str(e):
                    raise
                if _detach_derived_attributes(module):
                    return method(module, *args, **kwargs)
                return _converted_without_swapping(method, module, args, kwargs)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
            _restore_parameter_kinds(kinds)
            target = NAME if method.__name__ != "cpu" and device is not None and device.type == NAME else None
            for slots, key, t in lazy:
                t._t2j_device = target
                slots[key] = t

    return convert


def _parameter_kinds(module):
    """(slots, key, type, attributes, hooks) of each of ``module``'s parameters: its type where that
    is a subclass of ``nn.Parameter`` (a user's ``class NoDecay(nn.Parameter)``, else None), the
    attributes a program set on it (``p.no_decay = True``) and its gradient hooks (``register_hook``,
    ``register_post_accumulate_grad_hook``). A move to or from the jax device swaps each parameter
    for a new ``nn.Parameter`` (torch's ``_apply`` for tensors of another kind), which has none of
    them, where a move between the CPU and CUDA (``param.data = ...``) keeps them all:
    `_restore_parameter_kinds`."""
    from .tensor import _USER_CLASSES, user_attributes

    found = []
    for m in module.modules():
        for key, p in m._parameters.items():
            if p is None:
                continue
            cls = _USER_CLASSES.get(type(p), type(p))
            subclass = cls if cls is not torch.nn.Parameter and issubclass(cls, torch.nn.Parameter) else None
            attributes = user_attributes(p)
            hooks = p._backward_hooks, p._post_accumulate_grad_hooks
            if subclass is not None or attributes or hooks != (None, None):
                found.append((m._parameters, key, subclass, attributes, hooks))
    return found


def _restore_parameter_kinds(found):
    from .tensor import on_jax_device

    for params, key, cls, attributes, (hooks, post_hooks) in found:
        p = params[key]
        if p is None:
            continue
        if cls is not None and not isinstance(p, cls):
            p.__class__ = on_jax_device(cls) if p.device.type == NAME else cls
        for name, value in attributes.items():
            if name not in p.__dict__:
                setattr(p, name, value)
        # set again even where the Python object still shows them: the swap moved their registration
        # with the tensor's autograd data; the same dicts, so that the handles returned remove them
        if hooks is not None:
            p._backward_hooks = hooks
        if post_hooks is not None:
            p._post_accumulate_grad_hooks = post_hooks


def _parameter_subclass_kept(original):
    """``nn.Parameter.__new__`` giving a subclass of ``nn.Parameter`` made from a jax tensor
    (``MyParam(w)``) that type, as on the CPU: torch's path for tensor subclasses returns the
    tensor itself, only marked as a parameter, so ``isinstance(p, MyParam)`` was False (and an
    optimizer grouping parameters by their type grouped them otherwise than on the CPU)."""

    @functools.wraps(original)
    def __new__(cls, data=None, requires_grad=True):
        from .tensor import Tensor, on_jax_device

        out = original(cls, data, requires_grad)
        if isinstance(out, Tensor) and not isinstance(out, cls):
            out.__class__ = on_jax_device(cls)
        return out

    return staticmethod(__new__)


def _make_subclass_of_jax_tensors(original):
    """``torch.Tensor._make_subclass(cls, data, requires_grad)`` of a jax tensor ``data``: a
    ``cls`` sharing its values, as for a CPU or CUDA tensor (a ``Parameter`` subclass's own
    ``__new__`` calls it, as bitsandbytes' do). torch refuses it for a tensor whose Python object
    is already of another type, as every jax tensor's is."""

    @functools.wraps(original)
    def _make_subclass(cls, data, require_grad=False, **kwargs):
        from .tensor import Tensor, on_jax_device

        if not isinstance(data, Tensor) or kwargs:
            return original(cls, data, require_grad, **kwargs)
        out = data.detach().requires_grad_(require_grad)  # (before cls's __torch_function__ sees it)
        out.__class__ = on_jax_device(cls)
        if issubclass(cls, torch.nn.Parameter):
            out._is_param = True
        return out

    return staticmethod(_make_subclass)


def _converted_without_swapping(method, module, args, kwargs):
    """``method(module, ...)`` giving the parameters that cannot be swapped in place new
    Parameter objects, as torch does for a move its ``.data =`` cannot make: an autograd graph
    still alive holds them (the output of an earlier forward on the CPU), and swap_tensors
    refuses to swap a tensor referenced elsewhere. Weights tied between submodules stay tied
    (one new Parameter for each old one); optimizers made before the move keep the old ones,
    as after such a move in torch."""
    slots = [(m._parameters, key, id(p)) for m in module.modules() for key, p in m._parameters.items()
             if p is not None]
    torch.__future__.set_swap_module_params_on_conversion(False)
    try:
        out = method(module, *args, **kwargs)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(True)
    first = {}
    for params, key, old in slots:
        params[key] = first.setdefault(old, params[key])
    return out


def _detach_derived_attributes(module) -> bool:
    """Detach the computed tensors modules keep as plain attributes (the old-style
    ``nn.utils.weight_norm`` keeps ``weight``, computed from ``weight_g`` and ``weight_v``).
    Their autograd graphs hold references to the parameters, which ``swap_tensors``
    refuses to swap; such a tensor is recomputed before it is used again (weight_norm's
    forward pre-hook). Returns whether any was found."""
    found = False
    for m in module.modules():
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(m, name, value.detach())
                found = True
    return found


def _take_uninitialized(module):
    """Takes a lazy module's uninitialized parameters and buffers out of it for a
    conversion. Swapping one for a jax tensor would make it an ordinary empty tensor
    (LazyLinear would then see a weight of shape (0,)), and an UninitializedParameter
    cannot hold a jax tensor itself; it stays a placeholder on the CPU that knows its
    device, and `_materialize` creates it there."""
    from torch.nn.parameter import UninitializedTensorMixin

    taken = []
    for m in module.modules():
        for slots in (m._parameters, m._buffers):
            for key, t in slots.items():
                if isinstance(t, UninitializedTensorMixin):
                    taken.append((slots, key, t))
                    slots[key] = None
    return taken


def _materialize(original):
    @functools.wraps(original)
    def materialize(self, shape, device=None, dtype=None):
        target = getattr(self, "_t2j_device", None)
        if target is None or device is not None:
            return original(self, shape, device, dtype)
        new = torch.empty(shape, device=target, dtype=dtype or self.data.dtype)
        if self.cls_to_become is torch.nn.Parameter:
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        # in place, as torch's materialize: the module (and any hook) keeps this object
        torch.utils.swap_tensors(self, new)

    return materialize


def _placeholder_on_cpu(original):
    # nn.LazyLinear(3, device="jax"): the placeholder lives on the CPU (see _take_uninitialized)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __new__(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        device = bound.arguments.get("device")
        if device is None or torch.device(device).type != NAME:
            return original(*args, **kwargs)
        bound.arguments["device"] = None
        t = original(*bound.args, **bound.kwargs)
        t._t2j_device = NAME
        return t

    return staticmethod(__new__)


def _deepcopy_keeps_device(original):
    @functools.wraps(original)
    def __deepcopy__(self, memo):
        result = original(self, memo)
        result._t2j_device = getattr(self, "_t2j_device", None)
        return result

    return __deepcopy__


def _has_jax_tensors(module) -> bool:
    return any(t.device.type == NAME for t in module.parameters()) or any(
        t.device.type == NAME for t in module.buffers()
    )


def register() -> None:
    """Install the backend (idempotent)."""
    if _libs:
        return
    if torch._C._get_privateuse1_backend_name() != NAME:
        torch.utils.rename_privateuse1_backend(NAME)
    torch._register_device_module(NAME, _DeviceModule())
    for name in ("synchronize", "memory_stats", "memory_allocated", "max_memory_allocated", "empty_cache"):
        setattr(torch.accelerator, name, _accelerator_api(name, getattr(torch.accelerator, name)))
    torch.to_dlpack = torch.utils.dlpack.to_dlpack = _to_dlpack(torch.utils.dlpack.to_dlpack)
    torch._C._acc.register_python_privateuseone_hook(_backend._DummyPrivateUse1Hook())
    torch._C._acc.register_python_privateuseone_device_guard(_backend._DummyDeviceGuard())
    torch.autograd.graph._engine_run_backward = _on_calling_thread(torch.autograd.graph._engine_run_backward)
    torch.autograd._engine_run_backward = torch.autograd.graph._engine_run_backward
    torch.Tensor.register_hook = _hook_errors_deferred(torch.Tensor.register_hook, gradient_hook=True)
    torch.Tensor.register_post_accumulate_grad_hook = _hook_errors_deferred(
        torch.Tensor.register_post_accumulate_grad_hook)
    torch.utils.hooks.BackwardHook.__init__ = _module_hook_errors_deferred(torch.utils.hooks.BackwardHook.__init__)
    torch.autograd.graph.saved_tensors_hooks.__init__ = _unpack_errors_deferred(
        torch.autograd.graph.saved_tensors_hooks.__init__)
    torch.compile = _keeping_dynamo_out_of_jax(torch.compile)
    torch.UntypedStorage.__new__ = _refusing_jax_storages(torch._C.StorageBase.__new__)
    for name in ("nested_tensor", "as_nested_tensor", "narrow"):
        setattr(torch.nested, name, _refusing_jax_nested(getattr(torch.nested, name)))
    if "torch._dynamo" in sys.modules:
        keep_dynamo_out_of_jax()
    torch.nn.Module.to = _swapping(torch.nn.Module.to)
    torch.nn.Module.cpu = _swapping(torch.nn.Module.cpu)
    torch.nn.Parameter.__new__ = _parameter_subclass_kept(torch.nn.Parameter.__new__)
    torch.Tensor._make_subclass = _make_subclass_of_jax_tensors(torch.Tensor._make_subclass)
    mixin = torch.nn.parameter.UninitializedTensorMixin
    mixin.materialize = _materialize(mixin.materialize)
    for cls in (torch.nn.UninitializedParameter, torch.nn.UninitializedBuffer):
        cls.__new__ = _placeholder_on_cpu(cls.__new__)
        cls.__deepcopy__ = _deepcopy_keeps_device(cls.__deepcopy__)
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, "PrivateUse1")
    # The boxed fallback cannot serve ops called with the Python key excluded (torch's
    # trampoline finds no Python kernel under the op's own name): torch.tensor(...,
    # device="jax") copies its data in with copy_, torch.tensor([jax scalars]) reads each
    # one with _local_scalar_dense, so these get kernels of their own.
    impl = torch.library.Library("aten", "IMPL")
    impl.impl("copy_", _copy, "PrivateUse1")
    impl.impl("_local_scalar_dense", functools.partial(_fallback, torch.ops.aten._local_scalar_dense.default),
              "PrivateUse1")
    impl.impl("_pin_memory", _pin_memory, "CPU")
    # torch's composite kernel turns x.set_(tensor, offset, size, stride) into a set_ to
    # the tensor's C++ storage, which a jax tensor's values are not in: kept whole here
    impl.impl("set_.source_Tensor_storage_offset", _set_to_tensor, "AutogradPrivateUse1")
    for overload in ("out", "out_tol_tensor", "atol_rtol_tensor_out", "atol_rtol_float_out"):
        op = getattr(torch.ops.aten.linalg_matrix_rank, overload)
        impl.impl(op._schema.name.split("::")[1] + "." + overload, _written_to_out("torch.linalg.matrix_rank", op),
                  "AutogradPrivateUse1")
    _libs.extend([fallback, impl])
    _linear_cross_entropy_defaults()
    # torch.autocast("jax") turns on AutocastPrivateUse1, whose kernels the backend must provide.
    from . import amp, gradcut

    amp.install()
    gradcut.install()


# How many backward passes (``backward()``, ``autograd.grad``) without ``create_graph`` have
# started in this process: `t2j.jit` tells a training step from a differentiable forward by it.
backward_passes = 0
# Called before each backward pass that accumulates into ``.grad`` (``backward()``, not ``autograd.grad``):
# a `t2j.jit` trace that holds no gradients as state stops there (`torch2jax.jit._watching_grads`).
accumulating_watchers: list = []


def _refusing_jax_storages(new):
    """``torch.UntypedStorage(n, device="jax")`` raising a clear error: a jax tensor's
    values are a jax.Array, not a storage torch allocates, and torch's allocator lookup
    for a device with none registered crashes the process."""

    @functools.wraps(new)
    def __new__(cls, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == NAME:
            raise RuntimeError(
                "torch2jax: a storage cannot be allocated on the jax device (its tensors hold jax.Arrays); "
                "create a tensor instead, e.g. torch.empty(n, dtype=torch.uint8, device='jax')"
            )
        return new(cls, *args, **kwargs)

    return staticmethod(__new__)


def nested_refusal(what: str) -> NotImplementedError:
    """The error for a nested tensor of torch's strided layout (``NestedTensorImpl``) on the jax device."""
    return NotImplementedError(
        f"torch2jax: nested tensors of the strided layout (torch.nested's default) are not supported on the jax "
        f"device ({what}). Build it with layout=torch.jagged (a jagged nested tensor holds a jax tensor of its "
        "values and works on the jax device), keep it on the CPU, or pad the sequences into one dense tensor "
        "(torch.nn.utils.rnn.pad_sequence, with a mask or lengths)")


def _refusing_jax_nested(make):
    """A ``torch.nested`` constructor raising `nested_refusal` for a strided nested tensor of jax tensors
    (or on ``device="jax"``): torch built one whose every later op failed in the dispatcher."""
    signature = inspect.signature(make)

    @functools.wraps(make)
    def nested(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        layout, device = bound.arguments.get("layout"), bound.arguments.get("device")
        if layout is not torch.jagged:
            on_jax = device is not None and not isinstance(device, int) and torch.device(device).type == NAME
            if on_jax or any(isinstance(t, torch.Tensor) and t.device.type == NAME
                             for t in torch.utils._pytree.tree_leaves((args, kwargs))):
                raise nested_refusal(f"torch.nested.{make.__name__} of jax tensors")
        return make(*args, **kwargs)

    return nested


def _on_calling_thread(engine_run_backward):
    """The autograd engine's entry point (``backward()``, ``autograd.grad``) running every
    backward node on the calling thread. The engine gives an accelerator device worker
    threads of its own, where the caller's thread-local settings (``t2j.env`` scopes, JAX's)
    are not seen; the CPU device already runs on the calling thread. An error a jax-device
    kernel raised in the pass is raised here, when the engine returns (see
    `torch2jax.dispatch.defer_backward_error`)."""

    @functools.wraps(engine_run_backward)
    def run(*args, **kwargs):
        from .dispatch import backward_pass

        global backward_passes
        # (outputs, grad_outputs, retain_graph, create_graph, inputs, ...)
        if not (args[3] if len(args) > 3 else kwargs.get("create_graph", False)):
            backward_passes += 1
        if kwargs.get("accumulate_grad", True):
            for watch in accumulating_watchers:
                watch()
        threaded = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)
        try:
            with backward_pass():
                return engine_run_backward(*args, **kwargs)
        finally:
            torch._C._set_multithreading_enabled(threaded)

    return run


def _hook_errors_deferred(register, gradient_hook: bool = False):
    """``Tensor.register_hook`` (``gradient_hook``) or ``register_post_accumulate_grad_hook``
    that, for a jax tensor, registers the hook through `torch2jax.dispatch.deferring_errors`;
    a gradient hook in torch code JAX differentiates runs in JAX's VJP
    (`torch2jax.gradcut.hook_where_jax_differentiates`)."""

    @functools.wraps(register)
    def run(self, hook):
        from . import gradcut
        from .dispatch import deferring_errors, tensor_hook_result
        from .tensor import Tensor

        if not isinstance(self, Tensor):
            return register(self, hook)
        if gradient_hook and gradcut._state.jax_differentiated and gradcut.differentiable(self._t2j_storage.array):
            # (JAX differentiates the code: its tensors need not require grad, and torch's engine is not what
            # computes their gradients; a backward() the code runs itself still runs the hook)
            return gradcut.hook_where_jax_differentiates(
                self, hook, register(self, hook) if self.requires_grad else None)
        return register(self, deferring_errors(hook, tensor_hook_result, jax_tensor=True))

    return run


def _module_hook_errors_deferred(init):
    """``BackwardHook.__init__`` (what runs a module's full backward hooks) with its user
    hooks behind `torch2jax.dispatch.deferring_errors`."""

    @functools.wraps(init)
    def run(self, module, user_hooks, user_pre_hooks):
        from .dispatch import deferring_errors, module_hook_result

        full, pre = module_hook_result("grad_input"), module_hook_result("grad_output")
        init(self, module, [deferring_errors(h, full) for h in user_hooks],
             [deferring_errors(h, pre) for h in user_pre_hooks])

    return run


def _unpack_errors_deferred(init):
    """``saved_tensors_hooks.__init__`` with its unpack hook behind
    `torch2jax.dispatch.unpacking_errors_deferred`."""

    @functools.wraps(init)
    def run(self, pack_hook, unpack_hook):
        from .dispatch import unpacking_errors_deferred

        init(self, pack_hook, unpacking_errors_deferred(unpack_hook))

    return run


def _pin_memory(x, device=None):
    """``x.pin_memory()`` of a CPU tensor. With the jax device registered, torch finds an
    accelerator and pins for it (``DataLoader(pin_memory=True)`` does), but a Python
    backend cannot provide a pinned allocator; JAX stages host transfers itself, so
    pinning for the jax device is a plain copy. Other devices pin as torch does."""
    target = torch.device(device) if device is not None else torch.accelerator.current_accelerator()
    if target is not None and target.type == NAME:
        return x.clone()
    return torch.ops.aten._pin_memory.default._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, x, device)


def _linear_cross_entropy_defaults() -> None:
    """``F.linear_cross_entropy``'s "auto" options are picked per device type and fall back
    to half-precision accumulation on a device torch does not know. XLA multiplies half
    inputs with float32 accumulation on every backend, so the jax device gets the CPU's
    picks: float32 accumulation, the "accurate" policy and its chunking."""
    try:
        from torch.nn.modules import linear_cross_entropy_options as lce
    except ImportError:  # a torch without the chunked linear_cross_entropy
        return
    for dtype in (torch.float16, torch.bfloat16):
        lce._AUTO_DEFAULTS.setdefault((NAME, dtype), lce._AUTO_DEFAULTS[("cpu", dtype)])
    original = lce.LinearCrossEntropyOptions._resolve_auto_acc_dtype

    def resolve_auto_acc_dtype(dtype, device):
        if device is not None and device.type == NAME and dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return original(dtype, device)

    lce.LinearCrossEntropyOptions._resolve_auto_acc_dtype = staticmethod(resolve_auto_acc_dtype)


def register_factories(lowerings) -> None:
    """Give each lowered factory op (no tensor arguments) a PrivateUse1 kernel.

    A factory such as ``arange`` has a CompositeExplicitAutograd kernel that
    allocates an empty tensor and fills it through ``out=``; a backend kernel
    takes precedence over it, so ``torch.arange(5, device="jax")`` reaches its
    lowering in one step.
    """
    impl = torch.library.Library("aten", "IMPL")
    done = set()
    for op in lowerings:
        if op.namespace != "aten" or op in done:
            continue
        if any(a.type.isSubtypeOf(torch._C.TensorType.get()) or "Tensor" in str(a.type) for a in op._schema.arguments):
            continue
        impl.impl(op._schema.name.split("::")[1] + ("." + op._overloadname if op._overloadname != "default" else ""),
                  functools.partial(_factory, op), "PrivateUse1")
        done.add(op)
    _libs.append(impl)


def _factory(op, *args, **kwargs):
    from .dispatch import dispatch

    return dispatch(op, args, kwargs)
