"""Lowerings of ATen ops to JAX, one module per op family.

Importing this package registers every lowering in `registry.LOWERINGS` /
`registry.VIEWS`.
"""

from . import registry  # noqa: F401  (first: the others register into it)
from . import (  # noqa: F401
    amp,
    conv,
    creation,
    elementwise,
    fft,
    foreach,
    indexing,
    linalg,
    nn,
    quantized,
    random,
    reductions,
    shape,
    sparse,
    special,
)

# Op families of other libraries' custom ops, imported the first time an op of that
# namespace is dispatched: their op overloads exist only once the library has loaded,
# and torch2jax does not depend on it.
_NAMESPACE_FAMILIES = {"torchvision": "vision"}


def load_namespace(namespace):
    """Register the lowerings of ``namespace``'s ops, if torch2jax has a family for it."""
    family = _NAMESPACE_FAMILIES.pop(namespace, None)
    if family is not None:
        import importlib

        importlib.import_module(f"{__name__}.{family}")
