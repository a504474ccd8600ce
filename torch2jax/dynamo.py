"""``torch.compile(model, backend="torch2jax")``: Dynamo graphs run as jitted JAX programs.

Dynamo captures the torch program (graph breaks, guards and recompiles are its
own), AOTAutograd splits each captured graph into a functional forward and
backward ATen graph (torch's decompositions applied, minus the ops torch2jax
lowers directly: `torch2jax.fx.decompositions`), and each of those becomes one
`jax.jit` program evaluated by `torch2jax.fx.run`. ``loss.backward()`` runs the
jitted backward; ``torch.optim`` steps outside the graphs as usual.

The model and its inputs may be ordinary torch CPU tensors or live on the jax
device. CPU tensors are handed to the JAX program and its results come back as
CPU tensors; jax tensors go in as their arrays and the results come back as jax
tensors (an output keeps the device torch gave it while tracing). Dynamo traces
a `torch2jax.Tensor` as a plain tensor on the jax device (a FakeTensor with
device ``jax:0``): see `trace_jax_tensors`.

Example::

    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to("jax")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cmodel = torch.compile(model, backend="torch2jax")
    loss = cmodel(torch.randn(16, 8, device="jax")).pow(2).mean()
    loss.backward()                   # the jitted JAX backward; .grad are jax tensors
    opt.step()
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from . import device as _device
from . import fx
from . import symbolic as _sym
from .env import _trace_state_clean, default_rng, drawn_key, next_key
from .ops import elementwise as _elementwise
from .tensor import Tensor, jax_array, new_tensor, torch_cpu

BACKEND = "torch2jax"


# dtypes NumPy holds as they are: such CPU tensors go to jax.jit as NumPy arrays,
# which it transfers in one batch (far cheaper than one jnp.asarray per tensor)
_NUMPY_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
}


def _array(t):
    if isinstance(t, Tensor):
        return t._value()
    if t.dtype in _NUMPY_DTYPES and t.device.type == "cpu":
        return t.detach().resolve_conj().resolve_neg().numpy()
    return jax_array(t)


def _output_kind(value):
    """How an output of the graph goes back to torch: by the example value torch traced."""
    if isinstance(value, torch.Tensor):
        return "jax" if value.device.type == "jax" else "cpu"
    if isinstance(value, (torch.SymInt, int)):
        return "int"
    if isinstance(value, (torch.SymFloat, float)):
        return "float"
    if isinstance(value, (torch.SymBool, bool)):
        return "bool"
    return "none"


_FROM_ARRAY = {
    "jax": new_tensor,
    "cpu": torch_cpu,
    "int": int,
    "float": float,
    "bool": bool,
}


def _to_torch(kind, value):
    return None if value is None else _FROM_ARRAY[kind](value)


def _as_array(value):
    if _sym.is_traced_number(value):  # a captured ``t.item()`` the graph returns
        return _sym.value_of(value)
    return None if value is None else jnp.asarray(value)


class GraphProgram:
    """One ATen graph as a jitted JAX function, called with torch values.

    Tensors are traced; integer inputs (sizes, under dynamic shapes) are static,
    so each distinct size compiles once. Random ops draw from torch2jax's RNG key,
    which is an input and an output of the program (inside `t2j.jit`, a subkey of the
    traced key); random CPU tensors from a key drawn from torch's CPU generator
    (`_draws_for_cpu`). A graph with ops whose result sizes depend on tensor values runs in
    pieces (`_pieces`).

    >>> gm = make_fx(lambda x, w: (torch.relu(x @ w),))(x, w)
    >>> (out,) = GraphProgram(gm, [x, w])(x, w)      # a torch CPU tensor, computed by XLA
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs):
        self.gm = gm
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        results = output.args[0]
        self.kinds = [_output_kind(n.meta.get("val") if isinstance(n, torch.fx.Node) else n) for n in results]
        self.static = [not isinstance(x, torch.Tensor) for x in example_inputs]
        self._jitted = jax.jit(self._program, static_argnums=2)
        self.cpu_random = _draws_for_cpu(gm)
        cuts = _sizes_from_values(gm)
        self._pieces = _pieces(gm, cuts) if cuts else None

    def _program(self, key, arrays, statics):
        args, tensors, values = [], iter(arrays), iter(statics)
        for static in self.static:
            args.append(next(values) if static else next(tensors))
        with default_rng.traced_key(key) as r:
            outs = fx.run(self.gm, *args)
        return [_as_array(o) for o in outs], r.key

    def _run_pieces(self, key, arrays, statics):
        """The graph in pieces (see `_pieces`): its data-dependent ops on concrete arrays
        between jitted runs of the rest. Inside a JAX trace there are no concrete arrays:
        those ops raise their error as in one program."""
        arrays, statics = iter(arrays), iter(statics)
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        env = {n: next(statics) if s else next(arrays) for n, s in zip(placeholders, self.static)}
        for piece in self._pieces:
            key = piece(key, env)
        output = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")
        outs = torch.fx.node.map_arg(output.args[0], env.__getitem__)
        return [_as_array(o) for o in outs], key

    def __call__(self, *args):
        arrays = [_array(a) for a, s in zip(args, self.static) if not s]
        statics = tuple(int(a) if isinstance(a, (int, torch.SymInt)) else a for a, s in zip(args, self.static) if s)
        # Called inside a JAX trace (the compiled code under t2j.jit), the program takes a
        # subkey of the traced key: its new key is a tracer the generator must not keep.
        traced = not _trace_state_clean()
        if self.cpu_random:  # random CPU tensors: a key from torch's CPU generator, as inductor takes its seeds
            key = next_key(torch.default_generator) if traced else drawn_key(torch.default_generator)
        else:
            key = default_rng.next_key() if traced else default_rng.key
        with jax.enable_x64(True):
            run = self._jitted if self._pieces is None else self._run_pieces
            outs, new_key = run(key, arrays, statics)
        if not (traced or self.cpu_random):
            default_rng.key = new_key
        return [_to_torch(k, o) for k, o in zip(self.kinds, outs)]


# ---------------------------------------------------------------------------
# graphs with data-dependent sizes (x[mask], nonzero, unique) run in pieces
# ---------------------------------------------------------------------------


def _sizes_from_values(gm: torch.fx.GraphModule) -> set:
    """The nodes of ``gm`` whose result sizes depend on tensor values: each defines an
    unbacked symbol (``u0`` of ``x[x > 0]``, ``nonzero``, ``unique``, an ``item()`` used as a
    size, under ``capture_dynamic_output_shape_ops``) that some tensor's shape holds. An
    ``item()`` that only enters arithmetic defines one too, but stays a traced number."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def symbols(node):
        val = node.meta.get("val")
        return free_unbacked_symbols(val) if val is not None else set()

    in_shapes = set()
    for node in gm.graph.nodes:
        for t in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if isinstance(t, torch.Tensor):
                in_shapes |= set(free_unbacked_symbols(t))
    cuts = set()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            new = set(symbols(node)).difference(*(symbols(a) for a in node.all_input_nodes))
            if new & in_shapes:
                cuts.add(node)
    return cuts


class _JitPiece:
    """A run of graph nodes as one `jax.jit` program over the values of the nodes it reads
    (``inputs``), returning the values of the nodes read after it (``outputs``).

    Values cross between pieces as host values: arrays, traced numbers (a captured
    ``item()``) as their arrays, and everything else (sizes, now concrete) static, so
    each distinct size of a data-dependent result compiles the piece once more.
    """

    def __init__(self, gm, nodes, inputs, outputs):
        self.gm, self.nodes, self.inputs, self.outputs = gm, nodes, inputs, outputs
        self._static_outputs = {}  # input signature -> the outputs' structure and static leaves
        self._jitted = jax.jit(self._program, static_argnums=2)

    def _program(self, key, arrays, layout):
        tree, kinds, statics, signature = layout
        env = dict(zip(self.inputs, jax.tree.unflatten(tree, _leaves_from(kinds, arrays, statics))))
        with default_rng.traced_key(key) as r:
            for node in self.nodes:
                fx.eval_node(self.gm, node, env)
        leaves, out_tree = jax.tree.flatten([env[n] for n in self.outputs])
        out_kinds, out_arrays, out_statics = _split_leaves(leaves)
        self._static_outputs[signature] = out_tree, out_kinds, out_statics
        return out_arrays, r.key

    def __call__(self, key, env):
        leaves, tree = jax.tree.flatten([env[n] for n in self.inputs])
        kinds, arrays, statics = _split_leaves(leaves)
        signature = (tree, kinds, statics, tuple((a.shape, str(a.dtype)) for a in arrays))
        out_arrays, key = self._jitted(key, arrays, (tree, kinds, statics, signature))
        out_tree, out_kinds, out_statics = self._static_outputs[signature]
        env.update(zip(self.outputs, jax.tree.unflatten(out_tree, _leaves_from(out_kinds, out_arrays, out_statics))))
        return key


def _split_leaves(leaves):
    """``leaves`` as (kinds, arrays, statics): an array is traced, a traced number goes as its
    array, anything else is a static value of the program."""
    kinds, arrays, statics = [], [], []
    for leaf in leaves:
        if _sym.is_traced_number(leaf):
            kinds.append("number")
            arrays.append(_sym.value_of(leaf))
        elif isinstance(leaf, (jax.Array, np.ndarray)):
            kinds.append("array")
            arrays.append(leaf)
        else:
            kinds.append("static")
            statics.append(leaf)
    return tuple(kinds), arrays, tuple(statics)


def _leaves_from(kinds, arrays, statics):
    """The leaves `_split_leaves` split, again (a traced number made anew from its array)."""
    arrays, statics = iter(arrays), iter(statics)
    return [next(statics) if k == "static" else _sym.traced_number(next(arrays)) if k == "number" else next(arrays)
            for k in kinds]


class _EagerPiece:
    """One op whose result sizes depend on tensor values, run on the concrete arrays."""

    def __init__(self, gm, node):
        self.gm, self.node = gm, node

    def __call__(self, key, env):
        fx.eval_node(self.gm, self.node, env)
        return key


def _pieces(gm: torch.fx.GraphModule, cuts: set) -> list:
    """``gm``'s nodes as pieces: each op in ``cuts`` alone, run eagerly, the runs between
    them jitted."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    pieces, run = [], []

    def close_run():
        if run:
            done = set(run)
            inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in done))
            last = position[run[-1]]
            outputs = [n for n in run if any(position[u] > last for u in n.users)]
            pieces.append(_JitPiece(gm, list(run), inputs, outputs))
            run.clear()

    for node in nodes:
        if node in cuts:
            close_run()
            pieces.append(_EagerPiece(gm, node))
        else:
            run.append(node)
    close_run()
    return pieces


def _draws_for_cpu(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` (or a subgraph of its control flow) makes random CPU tensors.

    Their program draws its key from torch's CPU generator on each call, which that draw
    advances: eager code after it, ``torch.manual_seed``, and ``get_rng_state`` /
    ``set_rng_state`` (``torch.utils.checkpoint`` replaying a dropout mask) see the CPU
    generator as they do around inductor's compiled random ops. A graph without random
    ops leaves it alone, as eager torch does; random jax tensors draw from the jax
    device's own generator, as CUDA ones from CUDA's.
    """
    for module in gm.modules():
        for node in getattr(module, "graph", torch.fx.Graph()).nodes:
            if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
                made = torch.utils._pytree.tree_leaves(node.meta.get("val"))
                if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in made):
                    return True
    return False


def _compile_graph(gm, example_inputs):
    return make_boxed_func(GraphProgram(gm, example_inputs))


def backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The Dynamo backend: AOTAutograd with torch2jax's decompositions, each forward and
    backward graph a `GraphProgram`. Registered as ``"torch2jax"``.

    >>> cmodel = torch.compile(model, backend="torch2jax")
    """
    if options:  # (mode="reduce-overhead", options={...}: Inductor's settings)
        warnings.warn(f"torch2jax dynamo backend: ignoring the options {sorted(options)}, which it does not take",
                      stacklevel=2)
    compile_with_aot = aot_autograd(
        fw_compiler=_compile_graph, bw_compiler=_compile_graph, decompositions=fx.decompositions()
    )
    _constants_made_on_host(gm)
    _elementwise.lower_inductor_prims()  # Dynamo's graph may hold prims.fma, defined as it traced
    # torch's LSTM decomposition picks oneDNN's CPU kernel (aten.mkldnn_rnn_layer, which has no
    # lowering) for CPU tensors while oneDNN is on: traced with it off, the graph holds the LSTM's own ops
    with torch.backends.mkldnn.flags(enabled=False):
        return compile_with_aot(gm, example_inputs)


# tensors made from Python data (``at::lift_fresh`` of a tensor made outside the trace)
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)


def _constants_made_on_host(gm: torch.fx.GraphModule) -> None:
    """Make each ``torch.tensor(data, device="jax")`` of Dynamo's graph on the CPU, then move it.

    AOTAutograd traces such a call by making the tensor for real and lifting it into the
    graph as a constant; on the jax device that constant meets the fake mode, which makes a
    fake of it (`tensor._as_fake`), and AOTAutograd refuses a graph with a fake constant when
    it differentiates (``Unexpected fake buffer _tensor_constant0``: transformers' cache makes
    ``torch.tensor([], device=...)``). A CPU constant is real, and the move is a graph op.
    """
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _FROM_DATA or not node.args:
            continue
        positional = node.target is torch.as_tensor and len(node.args) > 2
        device = node.args[2] if positional else node.kwargs.get("device")
        data = torch.utils._pytree.tree_leaves(node.args[0])
        if not isinstance(device, (str, torch.device)) or torch.device(device).type != _device.NAME \
                or node.kwargs.get("requires_grad") or any(isinstance(a, torch.fx.Node) for a in data):
            continue
        if positional:
            node.args = (*node.args[:2], "cpu", *node.args[3:])
        else:
            node.kwargs = {**node.kwargs, "device": "cpu"}
        with graph.inserting_after(node):
            moved = graph.call_method("to", (node, device))
        node.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
        changed = True
    if changed:
        gm.recompile()


def skip_jax_frames() -> None:
    """Keep Dynamo out of JAX and torch2jax frames (done on import).

    Where a torch2jax tensor runs eagerly under Dynamo (after a graph break, or
    under another backend, see `trace_jax_tensors`), the ops reach
    ``__torch_dispatch__`` in Python frames that Dynamo would otherwise try to
    compile, and break JAX.
    """
    _device.keep_dynamo_out_of_jax()


def register() -> None:
    """Register `backend` as ``"torch2jax"`` by hand.

    Installing the package already makes ``torch.compile(..., backend="torch2jax")``
    find it (the ``torch_dynamo_backends`` entry point, which imports this module on
    first use, so ``import torch2jax`` does not pay for importing Dynamo); this is for
    a source tree used without installing it.

    >>> torch2jax.dynamo.register()
    """
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if _COMPILER_FNS.get(BACKEND) is not backend:
        _COMPILER_FNS.pop(BACKEND, None)
        register_backend(backend, name=BACKEND)


def _compiles_for_torch2jax(compiler_fn) -> bool:
    """Whether Dynamo's ``compiler_fn`` is `backend` under torch's wrappers
    (``torch.compile``'s `_TorchCompileWrapper`, Dynamo's debug wrapper)."""
    seen = set()
    while compiler_fn is not None and id(compiler_fn) not in seen:
        if compiler_fn is backend:
            return True
        seen.add(id(compiler_fn))
        compiler_fn = next(
            (getattr(compiler_fn, a) for a in ("_torchdynamo_orig_backend", "compiler_fn", "__wrapped__")
             if hasattr(compiler_fn, a)),
            None,
        )
    return False


def _polyfill_hf_torchax_check() -> None:
    """Give Dynamo a traceable HF transformers ``is_jax_jitting`` (once transformers is loaded).

    HF's ``is_tracing(tensor)`` asks ``is_jax_jitting(tensor)``, which calls
    ``tensor.jax()`` to spot torchax tensors under ``jax.jit``. On a jax tensor that
    call is a graph break (Dynamo does not trace into torch2jax), one in every GPT-2
    forward. Its answer is or-ed with ``is_torchdynamo_compiling()``, which is True
    wherever Dynamo traces, so there it changes nothing: the substitute says False.
    """
    import_utils = sys.modules.get("transformers.utils.import_utils")
    check = getattr(import_utils, "is_jax_jitting", None)
    if check is None or check in _POLYFILLED:
        return
    _POLYFILLED.add(check)
    # Dynamo inlines the substitute, and it skips every file of this package: the
    # substitute's code is compiled from a string so that it belongs to none.
    torch._dynamo.substitute_in_graph(check)(eval("lambda x: False"))  # noqa: S307 - a constant source


# the functions `_polyfill_hf_torchax_check` gave Dynamo a substitute for
_POLYFILLED: set = set()


def trace_jax_tensors() -> None:
    """Let Dynamo trace `torch2jax.Tensor` when it compiles for this backend (done on import).

    Dynamo traces a tensor subclass only when it keeps torch's ``__torch_dispatch__``
    or is a traceable wrapper subclass (``__tensor_flatten__``); any other one, as a
    torch2jax tensor, is an opaque object, and the first op on it is a graph break.
    Yet `FakeTensorMode.from_tensor` already makes a faithful stand-in of a jax tensor:
    a plain FakeTensor on the ``jax:0`` device with its shape, strides and dtype. So,
    for graphs compiled by `backend` only, Dynamo's `VariableBuilder` wraps a jax
    tensor as it wraps a CUDA tensor; AOTAutograd then traces an ATen graph on the
    ``jax:0`` device, which `GraphProgram` runs on the tensors' arrays. Other backends
    (inductor cannot generate code for the jax device) see torch2jax tensors as
    before and run them eagerly.

    >>> cmodel = torch.compile(model.to("jax"), backend="torch2jax")
    >>> torch._dynamo.utils.counters["stats"]["unique_graphs"]   # after cmodel(x) on jax tensors
    1
    """
    from torch._dynamo.variables import builder

    wrap = builder.VariableBuilder._wrap
    if getattr(wrap, "_torch2jax", False):
        return
    subclass_type = builder.infer_subclass_type

    def _wrap(self, value):
        if isinstance(value, Tensor) and _compiles_for_torch2jax(self.tx.output.compiler_fn):
            _polyfill_hf_torchax_check()
            _PLAIN.add(id(value))
            try:
                return self.wrap_tensor(value)
            finally:
                _PLAIN.discard(id(value))
        return wrap(self, value)

    def _infer_subclass_type(value):
        # a plain tensor to Dynamo (a TensorVariable): as a subclass it went through Dynamo's
        # __torch_function__ emulation, which breaks the graph at torch.Tensor's Python methods
        # (x.split(sizes)) and names a class global it never installed in its output code (x > 0)
        return None if id(value) in _PLAIN else subclass_type(value)

    _wrap._torch2jax = True
    builder.VariableBuilder._wrap = _wrap
    builder.infer_subclass_type = _infer_subclass_type


# ids of the jax tensors `trace_jax_tensors` is wrapping as plain tensors
_PLAIN: set = set()


skip_jax_frames()
trace_jax_tensors()
