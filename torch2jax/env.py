"""The torch2jax environment: scoped configuration and the random-number state.

Configuration is a stack of immutable `Config` values. ``t2j.enable()`` sets the
process-wide base; ``with t2j.env(...)`` pushes an override for the current
thread only, so settings never leak between threads or between tests.

Example::

    import torch, torch2jax as t2j

    with t2j.env(fallback="error"):          # host fallbacks raise instead of warn
        x = torch.randn(4, 8, device="jax")
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import weakref

import jax
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings read by the dispatcher.

    fallback: what happens when an op has neither a lowering nor a decomposition
        and runs on the host through torch: ``"warn"`` (once per op), ``"silent"``
        or ``"error"``.
    check_indices: ``True`` (the default): in eager mode, raise torch's error for
        out-of-range indices and for the values torch's kernels check (one_hot
        classes, nll_loss targets, binary cross-entropy probabilities, CTC
        lengths, integer divisors); costs a device sync per such op. Inside a traced program
        (`t2j.jit`, ``jax.jit``) values are unknown when it is traced, so nothing
        is checked there: JAX clamps out-of-range gather indices and drops
        out-of-range scatter updates. ``"always"``: also check inside traced
        programs, when they run (a host callback per check; `t2j.jit` raises
        torch's error to the caller and leaves the state unchanged; it is part of
        `t2j.jit`'s cache key, so a function traced without it is traced again).
        ``False``: check nothing.
    """

    fallback: str = "warn"
    check_indices: bool | str = True

    def __post_init__(self):
        if self.fallback not in ("warn", "silent", "error"):
            raise ValueError(f"torch2jax: fallback must be 'warn', 'silent' or 'error', got {self.fallback!r}")
        if self.check_indices not in (True, False, "always"):
            raise ValueError(f"torch2jax: check_indices must be True, False or 'always', got {self.check_indices!r}")


_global_config = Config()
_enabled = False
_local = threading.local()


def config() -> Config:
    """The configuration in effect on this thread."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else _global_config


@contextlib.contextmanager
def env(**overrides):
    """Run a block with torch2jax settings (see `Config`); re-entrant and thread-local.

    The "jax" device is usable anywhere once torch2jax is imported; the block
    scopes configuration and turns on JAX's 64-bit types for the thread, so
    int64 / float64 tensors keep their dtypes as in torch.

    >>> with t2j.env():
    ...     y = torch.ones(3, device="jax") * 2
    """
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(dataclasses.replace(config(), **overrides))
    try:
        with jax.enable_x64(True):
            yield stack[-1]
    finally:
        stack.pop()


def enable(**overrides) -> None:
    """Turn torch2jax on for the whole process, with optional settings (see `Config`).

    >>> t2j.enable(); x = torch.zeros(2, device="jax"); t2j.disable()
    """
    global _global_config, _enabled
    _global_config = dataclasses.replace(_global_config, **overrides)
    _enabled = True


def disable() -> None:
    """Undo `enable`: restore the default configuration."""
    global _global_config, _enabled
    _global_config = Config()
    _enabled = False


def is_enabled() -> bool:
    return _enabled or bool(getattr(_local, "stack", None))


# ---------------------------------------------------------------------------
# Random numbers (DESIGN.md, decision 5)
# ---------------------------------------------------------------------------


class RngState:
    """A JAX PRNG key that is split on every draw, seeded like a torch generator.

    While a function is traced by `t2j.jit` (or a functionalized module is called
    with ``rng=``), draws come from a traced key that is an input of the compiled
    program instead (`traced_key`), so every call gets fresh random numbers.
    """

    def __init__(self, seed: int):
        self.seed(seed)
        self._traced = None
        # whether the key of the innermost `traced_key` block is a concrete one given outside any JAX trace
        # (``with t2j.rng_key(key): jax.jit(f)(x)``): a program staged inside it must not bake it in
        self._outside = False
        self._block_trace = None  # the JAX trace the innermost `traced_key` block was entered in
        self.draws = 0  # draws from the traced key in the innermost `traced_key` block
        self.generator_draws = None  # inside a t2j.jit trace: its `GeneratorDraws`
        self.loop_bodies = 0  # loop bodies (t2j.scan, fori_loop, while_loop, scan_layers) being traced

    def seed(self, seed: int) -> None:
        self.initial_seed = int(seed)
        self._key = None
        if getattr(self, "_traced", None) is not None:
            # seeded inside a traced function: the program's later draws restart from the
            # seed on every call, as the eager function's do
            with jax.ensure_compile_time_eval():
                self._traced = self.key
            self._outside = False  # (the program's own seed: its draws are the same on every call, as eagerly)

    @property
    def key(self):
        if self._key is None:
            s = self.initial_seed & 0xFFFFFFFFFFFFFFFF
            self._key = seeded_key(s & 0xFFFFFFFF, s >> 32)
        return self._key

    @key.setter
    def key(self, value):
        self._key = value

    def next_key(self):
        if self._traced is not None:
            key = self._traced
            nested = _traces_inside(self._block_trace)
            if nested:
                _refuse_repeated_draws(nested)
            if nested and not self._outside:
                # (split in the block's own trace: the new key must not be a tracer of a JAX transform
                # traced inside the block (a jax.checkpoint or cond body, an inner jax.jit), which ends first)
                from jax._src import core

                with core.set_current_trace(self._block_trace):
                    self._traced, sub = jax.random.split(key)
            else:
                self._traced, sub = jax.random.split(key)
            if self._outside and isinstance(sub, jax.core.Tracer):
                # (the concrete key split into a staged program: jax.grad or vmap would split it concretely)
                self._traced = key
                raise RuntimeError(
                    "torch2jax: a random op ran inside jax.jit (or another JAX transform) whose `t2j.rng_key` "
                    "block was entered outside it: its key would be a constant of the compiled program, every "
                    "call drawing the same numbers. Pass the key to the jitted function and enter "
                    "`with t2j.rng_key(key):` inside it (or pass rng=key to a functionalized module).")
            self.draws += 1
            return sub
        if not _trace_state_clean():
            raise RuntimeError(
                "torch2jax: a random op ran inside jax.jit (or another JAX transform) with no RNG key to "
                "draw from; its random numbers would be baked into the compiled program. Use t2j.jit, or "
                "pass a key: fn(state, *args, rng=key) for a functionalized module, or "
                "`with t2j.rng_key(key):` around the code."
            )
        return self.next_stored_key()

    def body_key(self):
        """The key a traced body (a t2j.scan / fori_loop / cond branch) draws from: the next key,
        or None inside a JAX transform that has none, where only a draw in the body raises
        (`next_key`): a body that draws nothing runs under a plain ``jax.jit``."""
        if self._traced is None and not _trace_state_clean():
            return None
        return self.next_key()

    def next_stored_key(self):
        """The next key of the stored stream, concrete also while a function is traced: the stored
        key never holds a tracer."""
        with jax.ensure_compile_time_eval():
            self.key, sub = _split(self.key)
        return sub

    def state_bytes(self) -> torch.Tensor:
        """The stored key's data, then the seed (8 bytes, little-endian), as bytes: a CPU uint8
        tensor, as torch's generators give their state (theirs holds the seed too). Inside a
        traced function the stream is the program's traced key, so the state is a jax tensor
        holding its traced bytes: what `set_state_bytes` takes back (``fork_rng``, reentrant
        checkpointing's replay, ``g.set_state(g.get_state())`` around draws)."""
        if self._traced is not None:
            from .tensor import new_tensor

            data = jax.random.key_data(self._traced).astype(jax.numpy.uint32)
            return new_tensor(jax.numpy.concatenate([jax.lax.bitcast_convert_type(data, jax.numpy.uint8).reshape(-1),
                                                     jax.numpy.asarray(_seed_bytes(self.initial_seed))]))
        with jax.ensure_compile_time_eval():
            data = np.asarray(jax.random.key_data(self.key)).astype(np.uint32)
        return torch.from_numpy(np.concatenate([data.view(np.uint8).reshape(-1), _seed_bytes(self.initial_seed)]))

    def set_state_bytes(self, state: torch.Tensor, caller: str) -> None:
        """Continue the stream from ``state`` (what `state_bytes` gave; without the seed, as
        states saved before it held one, the seed stays)."""
        sizes = (4 * KEY_WORDS + 8, 4 * KEY_WORDS)
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() not in sizes:
            got = (f"a {state.dtype} tensor of {state.numel()} elements" if isinstance(state, torch.Tensor)
                   else type(state).__name__)
            # (the error types of torch's CPU generator: a wrong size is a RuntimeError)
            error = RuntimeError if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 else TypeError
            raise error(f"{caller}: expected the state a jax-device generator gives (a torch.uint8 tensor of "
                        f"{sizes[0]} bytes, from get_state()), got {got}")
        if self._traced is not None:
            # inside a trace: the program's stream restarts from ``state`` on every call, as the eager
            # function's does (the seed after the key stays)
            from .tensor import Tensor

            data = state._value() if isinstance(state, Tensor) else jax.numpy.asarray(state.cpu().numpy())
            data = data.astype(jax.numpy.uint8).reshape(-1)[:4 * KEY_WORDS]
            self._traced = jax.random.wrap_key_data(jax.lax.bitcast_convert_type(data.reshape(-1, 4),
                                                                                 jax.numpy.uint32))
            self._outside = False
            return
        raw = state.detach().cpu().numpy().reshape(-1)
        data = raw[:4 * KEY_WORDS].copy().view(np.uint32)
        with jax.ensure_compile_time_eval():
            key = jax.random.wrap_key_data(jax.numpy.asarray(data))
        if raw.size == sizes[0]:
            self.initial_seed = int(raw[4 * KEY_WORDS:].copy().view("<u8")[0])
        self.key = key

    @contextlib.contextmanager
    def traced_key(self, key):
        """Draw from ``key`` (usually a tracer) inside the block; ``block.key`` is the
        key after the last draw, to be carried to the next call."""
        from jax._src import core

        outer, outer_draws, outer_outside, outer_trace = self._traced, self.draws, self._outside, self._block_trace
        box = _KeyBox(key)
        self._traced, self.draws, self._block_trace = key, 0, core.trace_ctx.trace
        self._outside = not isinstance(key, jax.core.Tracer) and _trace_state_clean()
        try:
            yield box
        finally:
            box.key = self._traced
            self._traced, self.draws, self._outside, self._block_trace = outer, outer_draws, outer_outside, outer_trace

    def stream_key(self):
        """The key the next draw splits: the traced key inside a trace, else the stored one.
        A block traced with it (`traced_key`) that draws ``n`` times and is followed by
        ``skip(n)`` draws what the same ops run one by one would."""
        return self._traced if self._traced is not None else self.key

    def skip(self, n: int) -> None:
        for _ in range(n):
            self.next_key()


def _seed_bytes(seed: int) -> np.ndarray:
    """The last 8 bytes of a generator's state: its seed, little-endian (`RngState.state_bytes`)."""
    return np.array([seed & 0xFFFFFFFFFFFFFFFF], "<u8").view(np.uint8)


class _KeyBox:
    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key


# How JAX names the bodies its loops trace (``DebugInfo.traced_for``): traced once, run once per iteration
_LOOP_BODIES = frozenset({"scan", "fori_loop", "while_body", "while_cond"})


def _traces_inside(block_trace) -> list:
    """The JAX traces running inside ``block_trace`` (a `traced_key` block's), innermost first: the
    transforms a draw is traced by that the block's key is not part of. Empty where ``block_trace``
    is the current trace or is not found among its parents (nothing known to be nested)."""
    from jax._src import core

    if block_trace is None:  # (a key set as the traced one without a block: a Function's rerun, t2j.jit's)
        return []
    nested, trace = [], core.trace_ctx.trace
    while trace is not None and trace is not block_trace:
        nested.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return nested if trace is block_trace else []


def _refuse_repeated_draws(nested) -> None:
    """Raise where a draw from a `traced_key` block's key runs in a loop body or under a vmap
    entered inside the block: traced once, every iteration or batch element would draw the same
    numbers (torch.func.vmap refuses random ops too, with its default ``randomness="error"``)."""
    from jax._src.interpreters import batching

    for trace in nested:
        debug = getattr(getattr(trace, "frame", None), "debug_info", None)
        where = ("jax.vmap" if isinstance(trace, batching.BatchTrace)
                 else f"a JAX {debug.traced_for} body" if debug is not None and debug.traced_for in _LOOP_BODIES
                 else None)
        if where is not None:
            raise RuntimeError(
                f"torch2jax: a random op ran under {where} traced inside the `t2j.rng_key` block (or the "
                "functionalized module call with rng=) that gives its key: the body is traced once, so every "
                "iteration or batch element would draw the same numbers. Give each one a key of its own and "
                "enter the block inside the body: split the key outside (jax.random.split(key, n), passed "
                "as the scan's xs or vmapped over) or carry it and split it in the body, then "
                "`with t2j.rng_key(k):` or fn(state, x, rng=k) there; t2j.scan carries the RNG key itself.")


def _trace_state_clean() -> bool:
    from jax._src import core

    return core.trace_state_clean()


@jax.jit
def _split(key):
    a, b = jax.random.split(key)
    return a, b


default_rng = RngState(torch.initial_seed())


def seeded_key(low, high):
    """The JAX key of a 64-bit seed given as its low and high 32-bit words (numbers or
    traced uint32 values: the same key either way)."""
    return jax.random.fold_in(jax.random.key(low), high)


def draw_seed(generator: torch.Generator) -> tuple[int, int]:
    """One draw from ``generator``'s torch state: a 64-bit seed as (low, high) 32-bit words."""
    seed = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, generator=generator)) & 0xFFFFFFFFFFFFFFFF
    return seed & 0xFFFFFFFF, seed >> 32


# uint32 words in a JAX key's data (2 for the default threefry keys)
KEY_WORDS = int(np.prod(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape))

# The key stream of each jax-device `Generator`, by the object torch's dispatcher hands ops for it
# (`_dispatched_generator`); the `Generator` holds that object, so it is the same for its lifetime.
_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stream(generator: torch.Generator) -> RngState | None:
    stream = getattr(generator, "_stream", None)
    return stream if stream is not None else _STREAMS.get(generator)


def drawn_key(generator: torch.Generator):
    """A concrete key from ``generator``: the next of a jax-device generator's stream (the
    default generator's kind of stream, so the same seed gives the same numbers), or, for a
    CPU generator, one made from a 64-bit seed drawn from its torch state."""
    stream = _stream(generator)
    if stream is not None:
        return stream.next_stored_key()
    low, high = draw_seed(generator)
    with jax.ensure_compile_time_eval():
        return seeded_key(low, high)


def drawn_key_data(generator: torch.Generator) -> np.ndarray:
    """`drawn_key`'s data: ``KEY_WORDS`` uint32 words."""
    with jax.ensure_compile_time_eval():
        return np.asarray(jax.random.key_data(drawn_key(generator))).reshape(KEY_WORDS)


def next_key(generator: torch.Generator | None = None):
    """A fresh JAX key from the stream of ``generator`` (default: the jax device's own).

    A ``torch.Generator(device="jax")`` has a stream of its own, split per draw like the
    default one: seeded with the same number, the two give the same draws, as CUDA's do.
    A CPU torch.Generator is accepted too: each draw takes a 64-bit seed from its torch
    state. Inside a `t2j.jit` trace the keys are program inputs, drawn from the
    generator on every call (`GeneratorDraws`).
    """
    if generator is None:
        return default_rng.next_key()
    if not _trace_state_clean():
        if default_rng.generator_draws is not None:
            return default_rng.generator_draws.key(generator)
        raise RuntimeError(
            "torch2jax: an explicit torch.Generator cannot drive random ops inside jax.jit or another JAX "
            "transform (its draws would be baked into the compiled program); use t2j.jit, which draws the "
            "generator's keys on every call, or drop generator= and seed with torch.manual_seed"
        )
    return drawn_key(generator)


# (dispatch's analysis of what a lowering refers to stops here: a random op's compiled eager call
# draws from its program's key input, `dispatch._Compiled.draws`)
next_key.not_followed = True


class GeneratorDraws:
    """The draws a `t2j.jit` trace takes from explicit torch.Generators.

    A generator that existed before the call is drawn from on every call: each of
    its draws in the program reads one row of ``keys`` (a traced ``(n, KEY_WORDS)``
    uint32 array, one `drawn_key_data` per row), so a call advances the generator and
    gets the numbers the eager function would. ``sources`` lists, per row, where the call
    finds the generator: the index of the argument it was passed as, or the
    generator itself (reached through a closure, a global, an attribute).

    A generator created inside the function, or re-seeded there through
    ``torch.Generator(device="jax")``'s methods, gives the same numbers on every
    call: its draws are taken at trace time and are constants of the program. A
    re-seeded generator is put back as it was before the trace (`restore`), and each
    call leaves it in the state the trace left it in (``reseeded``: per generator,
    its source and that state).

    A random op on the CPU (``torch.randperm(n)``, ``torch.randn(4).to(x.device)``)
    draws from torch's own generator while the function is traced, and Python's
    ``random`` and ``numpy.random`` draw on the host: their numbers would be constants
    of the program. ``drew_on_the_host`` (set by `restore`) tells, from the states of
    torch's default CPU generator, of the generators among the arguments and those the
    function reaches (``reached``), and of Python's and NumPy's global generators, so
    that the function runs eagerly instead; a ``torch.manual_seed`` inside the function
    makes the CPU draws after it the same on every call, as above.

    Generators are compared as torch's dispatcher hands them to ops
    (`_dispatched_generator`), which is not the Python object the user holds.
    """

    def __init__(self, keys, leaves, reached=()):
        self.keys = keys
        self.sources: list = []
        # (the dispatcher's object for an argument, its index): held, as the dispatcher makes a new one
        # for a generator whose object has died
        self.arguments = [(g, i) for i, x in enumerate(leaves) if isinstance(x, torch._C.Generator)
                          and (g := _dispatched_generator(x)) is not None]
        reached = list(reached)
        host = [g for g in reached if isinstance(g, HOST_RNGS)]
        self.start = [(g, g.get_state()) for g in (torch.default_generator, *(g for g, _ in self.arguments),
                                                   *filter(None, (_dispatched_generator(g) for g in reached
                                                                  if isinstance(g, torch._C.Generator))))]
        self.python_start = random.getstate(), np.random.get_state()
        self.host_start = [(g, _host_rng_state(g)) for g in host]
        self.created: list = []
        self.before: list = []  # (generator, its state before the trace) for each one re-seeded in it
        self.default_seeds: list = []  # the seeds given to the jax device's generator (`reseeding_the_default`)
        self.reseeded: list = []
        self.drew_on_the_host = False

    def fixed(self, generator) -> bool:
        """Whether ``generator``'s draws are the same on every call (created or re-seeded in the trace)."""
        dispatched = _dispatched_generator(generator)
        return dispatched is not None and self._fixed(dispatched)

    def _fixed(self, generator) -> bool:
        """Whether ``generator``'s draws are the same on every call (created or re-seeded in the trace)."""
        return any(generator is g for g in self.created) or any(generator is g for g, _ in self.before)

    def key(self, generator):
        key = self._key(generator)
        if default_rng.loop_bodies:
            # a draw in a loop body runs once per iteration: each gets numbers of its own, told
            # apart by a draw from the loop's key (which the loop carries from iteration to iteration)
            key = jax.random.fold_in(key, jax.random.bits(default_rng.next_key(), (), np.uint32))
        return key

    def _key(self, generator):
        if self._fixed(generator):
            return drawn_key(generator)
        row = len(self.sources)
        self.sources.append(self._source(generator))
        if self.keys is None or row >= self.keys.shape[0]:
            return jax.random.key(0)  # this trace is redone with a row for every draw (`complete`)
        return jax.random.wrap_key_data(self.keys[row])

    def _source(self, generator):
        return next((i for g, i in self.arguments if g is generator), generator)

    def creating(self, generator) -> None:
        self.created.append(_dispatched_generator(generator))

    def reseeding(self, generator) -> None:
        """``generator`` is about to be re-seeded (``manual_seed``, ``set_state``, ``seed``)."""
        generator = _dispatched_generator(generator)
        if not self._fixed(generator):
            self.before.append((generator, generator_state(generator)))

    def reseeding_the_default(self, seed: int) -> None:
        """The jax device's generator is re-seeded with ``seed``: by ``torch.manual_seed(seed)``, which
        re-seeds the CPU generator too (after the devices' in torch 2.13, before them in earlier
        versions), or by ``torch.jax.manual_seed`` alone. `restore` tells which from the CPU generator's
        seed: only the first makes the CPU draws after it the same on every call."""
        cpu = torch.default_generator
        if not self._fixed(cpu):
            self.before.append((cpu, (self.start[0][1], None)))
            self.default_seeds.append(seed)

    @property
    def complete(self) -> bool:
        """Whether ``keys`` had exactly one row per draw the trace took."""
        return len(self.sources) == (0 if self.keys is None else self.keys.shape[0])

    def restore(self) -> None:
        """Put the generators the trace re-seeded or drew from on the CPU back as they were before it."""
        if self.default_seeds and torch.initial_seed() != self.default_seeds[-1]:  # (the jax device's alone)
            self.before = [(g, state) for g, state in self.before if g is not torch.default_generator]
        self.reseeded = [(self._source(g), generator_state(g)) for g, _ in self.before]
        python, numpy = self.python_start
        self.drew_on_the_host = (any(not self._fixed(g) and not torch.equal(g.get_state(), state)
                                     for g, state in self.start)
                                 or random.getstate() != python or not _same_numpy_state(np.random.get_state(), numpy)
                                 or any(not _same_numpy_state(_host_rng_state(g), state) for g, state in self.host_start))
        random.setstate(python)
        np.random.set_state(numpy)
        for g, state in self.host_start:
            _set_host_rng_state(g, state)
        for g, state in self.start:
            g.set_state(state)
        for g, state in self.before:
            set_generator_state(g, state)


def generator_state(generator: torch.Generator) -> tuple:
    """All of ``generator``'s state: its torch state (what CPU ops draw from) and, for a jax-device
    generator, its key stream's."""
    stream = _stream(generator)
    return torch._C.Generator.get_state(generator), None if stream is None else stream.key


def set_generator_state(generator: torch.Generator, state: tuple) -> None:
    torch_state, key = state
    torch._C.Generator.set_state(generator, torch_state)
    if key is not None:
        _stream(generator).key = key


def _same_numpy_state(a, b) -> bool:
    if isinstance(a, dict):  # (a numpy Generator's bit generator state)
        return a.keys() == b.keys() and all(_same_numpy_state([a[k]], [b[k]]) for k in a)
    return all(_same_numpy_state(x, y) if isinstance(x, dict) else np.array_equal(x, y)
               if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


# Random number generators of Python and NumPy that a function may hold (``rng = random.Random(0)``,
# ``np.random.default_rng()``): a draw from one while t2j.jit traces is a draw on the host (`GeneratorDraws`)
HOST_RNGS = (random.Random, np.random.Generator, np.random.RandomState)


def _host_rng_state(g):
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    return g.get_state() if isinstance(g, np.random.RandomState) else g.getstate()


def _set_host_rng_state(g, state) -> None:
    if isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    elif isinstance(g, np.random.RandomState):
        g.set_state(state)
    else:
        g.setstate(state)


class _SeeGenerator(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.generator = kwargs["generator"]
        return args[0]


def _dispatched_generator(generator: torch.Generator) -> torch.Generator | None:
    """The object torch's dispatcher passes ops for ``generator``: a wrapper of the same C++
    generator, made on first use and the same from then on (not ``generator`` itself)."""
    empty = torch.empty(0, device="cpu")
    see = _SeeGenerator()
    try:
        with see:
            empty.uniform_(generator=generator)
    except RuntimeError:  # a generator of another device (cuda): no op of ours draws from it
        return None
    return see.generator


@contextlib.contextmanager
def generator_draws(keys, leaves, reached=()):
    """Inside the block (a `t2j.jit` trace), draws from explicit generators come from ``keys``
    (see `GeneratorDraws`, the block's value)."""
    outer = default_rng.generator_draws
    draws = default_rng.generator_draws = GeneratorDraws(keys, leaves, reached)
    try:
        yield draws
    finally:
        default_rng.generator_draws = outer
        draws.restore()


class _GeneratorType(type(torch._C.Generator)):
    # `torch.Generator` is replaced by `Generator` below: every generator torch
    # makes (torch.default_generator, torch.Generator() on the CPU) must still
    # count as one.
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch._C.Generator)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, torch._C.Generator)


class Generator(torch._C.Generator, metaclass=_GeneratorType):
    """``torch.Generator``, also for ``device="jax"``.

    torch builds a generator for a PrivateUse1 device through a C++ hook that
    cannot be registered from Python, so ``torch2jax`` puts this class in
    ``torch.Generator``'s place. For other devices it returns torch's own
    generator; for the jax device, one with a JAX key stream of the default
    generator's kind: seeded with the same number, it draws what
    ``torch.manual_seed`` makes the default one draw, as a CUDA generator does.
    ``manual_seed``, ``seed``, ``initial_seed``, ``get_state`` and ``set_state``
    work as in torch (the state is the stream's key, in the format of
    ``torch.jax.get_rng_state()``). Random ops on the jax device draw their keys
    from it (`next_key`).

    >>> g = torch.Generator(device="jax").manual_seed(0)
    >>> torch.randn(3, device="jax", generator=g)
    """

    def __new__(cls, device="cpu"):
        device = torch.device(device)
        if device.type != _device_name():
            g = torch._C.Generator(device)
        else:
            _check_device_index(device)
            g = super().__new__(cls, "cpu")
            g._stream = RngState(g.initial_seed())
            # torch's dispatcher hands ops another object for this generator: held here, so
            # that it is the same one for as long as the generator lives
            g._dispatched = _dispatched_generator(g)
            _STREAMS[g._dispatched] = g._stream
        if default_rng.generator_draws is not None:
            default_rng.generator_draws.creating(g)
        return g

    # re-seeding inside a t2j.jit trace makes the later draws the same on every call (`GeneratorDraws`)
    def manual_seed(self, seed):
        self._reseeding()
        super().manual_seed(seed)
        self._stream.seed(super().initial_seed())
        return self

    def seed(self):
        self._reseeding()
        seed = super().seed()
        self._stream.seed(seed)
        return seed

    def get_state(self) -> torch.Tensor:
        draws = default_rng.generator_draws
        if draws is not None and not draws.fixed(self):
            from .dispatch import OpError

            # (its draws in the program are keys the call passes in: a state read here would be the
            # trace's, and a set_state of it would replay the trace's numbers on every call)
            raise OpError(
                "t2j.jit: get_state() of a torch.Generator the function draws from: its state inside the program "
                "differs from call to call, which a trace cannot read, so the function runs eagerly "
                "(torch.jax.get_rng_state() of the default generator stays in the program)")
        return self._stream.state_bytes()

    def set_state(self, new_state):
        self._reseeding()
        self._stream.set_state_bytes(new_state, "Generator.set_state")
        super().manual_seed(self._stream.initial_seed)  # (what initial_seed() reads; the stream keeps its key)
        return self

    def _reseeding(self):
        if default_rng.generator_draws is not None:
            default_rng.generator_draws.reseeding(self)

    @property
    def device(self) -> torch.device:
        return torch.device(_device_name(), 0)

    def __repr__(self):
        return f"<torch2jax Generator on {self.device}>"

    def __reduce__(self):
        return _generator_from_state, (self.initial_seed(), self.get_state())


def _generator_from_state(seed, state):
    g = Generator(_device_name()).manual_seed(seed)
    g.set_state(state)
    return g


def _check_device_index(device: torch.device) -> None:
    if device.index not in (None, 0):
        raise RuntimeError(f"torch.Generator: device {device} does not exist; the jax device is one device, "
                           f"{_device_name()}:0")


def _device_name():
    from .device import NAME

    return NAME


torch.Generator = Generator


def rng_key(key):
    """Context manager: random ops on the jax device inside the block draw from the
    JAX key ``key`` (split per draw) instead of the default generator; the block's
    value holds the key after the last draw (``.key``).

    >>> with t2j.rng_key(jax.random.key(0)) as r:
    ...     mask = torch.rand(3, device="jax") > 0.5
    >>> r.key     # the key to pass to the next call
    """
    check_key(key, "t2j.rng_key: key")
    return default_rng.traced_key(key)


def check_key(key, what: str) -> None:
    """Refuse ``key`` unless it is one JAX PRNG key: ``jax.random.key(seed)``, or the raw uint32 data
    of one (``jax.random.PRNGKey(seed)``). Checked where it is given, as a draw from anything else
    fails deep inside the op that draws, or never where nothing draws."""
    arrays = (jax.Array, jax.core.Tracer, np.ndarray)
    typed = isinstance(key, arrays) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if (typed and key.shape == ()) or (isinstance(key, arrays) and key.dtype == np.uint32 and key.ndim == 1):
        return
    got = f"an array of shape {tuple(key.shape)} and dtype {key.dtype}" if isinstance(key, arrays) \
        else type(key).__name__
    several = "; for one draw per key of a batch of keys, jax.vmap over them" if typed else ""
    raise TypeError(f"{what} must be a single JAX PRNG key (jax.random.key(seed)), got {got}{several}")


def manual_seed(seed: int) -> None:
    """Seed the jax device's default generator; torch.manual_seed calls this."""
    if default_rng.generator_draws is not None:
        default_rng.generator_draws.reseeding_the_default(seed)
    default_rng.seed(seed)


def rng_state_bytes() -> torch.Tensor:
    """``torch.jax.get_rng_state()``: the default stream's key as bytes (`RngState.state_bytes`)."""
    return default_rng.state_bytes()


def set_rng_state_bytes(state: torch.Tensor) -> None:
    """``torch.jax.set_rng_state(state)`` (`RngState.set_state_bytes`)."""
    default_rng.set_state_bytes(state, "torch.jax.set_rng_state")
