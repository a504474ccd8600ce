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
    special,
)
