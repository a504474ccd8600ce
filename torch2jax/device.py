"""The "jax" device: PyTorch's PrivateUse1 backend, renamed and routed to torch2jax.

Factory ops on ``device="jax"`` (``torch.randn(3, device="jax")``) and copies
from CPU (``t.to("jax")``, ``module.to("jax")``) reach PrivateUse1 kernels;
a boxed fallback sends them all to `torch2jax.dispatch.dispatch`. Tensors
already on the device dispatch through `torch2jax.Tensor.__torch_dispatch__`.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.backend_registration as _backend

from . import env as _env

NAME = "jax"


class _DeviceModule:
    """What torch asks a backend module for (``torch.jax`` after registration)."""

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
    def seed_all() -> None:
        _env.manual_seed(torch.seed())

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
    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16, torch.float32]

    @staticmethod
    def synchronize(device=None) -> None:
        return None


def _fallback(op, *args, **kwargs):
    from .dispatch import dispatch

    return dispatch(op, args, kwargs)


def _copy(dst, src, non_blocking=False):
    from .dispatch import dispatch

    return dispatch(torch.ops.aten.copy_.default, (dst, src, non_blocking), {})


_libs = []


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
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            return method(module, *args, **kwargs)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)

    return convert


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
    torch._C._acc.register_python_privateuseone_hook(_backend._DummyPrivateUse1Hook())
    torch._C._acc.register_python_privateuseone_device_guard(_backend._DummyDeviceGuard())
    torch.nn.Module.to = _swapping(torch.nn.Module.to)
    torch.nn.Module.cpu = _swapping(torch.nn.Module.cpu)
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, "PrivateUse1")
    # The boxed fallback cannot serve copy_ when torch.tensor(..., device="jax")
    # copies with the Python key excluded, so copy_ gets a kernel of its own.
    impl = torch.library.Library("aten", "IMPL")
    impl.impl("copy_", _copy, "PrivateUse1")
    _libs.extend([fallback, impl])
    # torch.autocast("jax") turns on AutocastPrivateUse1, whose kernels the backend must provide.
    from . import amp

    amp.install()


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
