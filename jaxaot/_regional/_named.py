"""Blocks the user names: ``jaxaot.jit(step, blocks=(...))``.

Code without any boundary (a plain Python loop of layers) marks no block. The
functions and module classes named in ``blocks`` get one while ``jaxaot.jit``
traces the program: each of their calls becomes an inner ``jit`` call (its
arrays passed as arguments, everything else fixed by the call), which the
block finder (``_auto``) turns into a block like any other.

* A module class: its ``__call__`` for the trace. Flax NNX modules go through
  ``nnx.jit`` (state they update is written back), other classes (Equinox
  modules, any pytree) through a jit of the call with the module's arrays as
  arguments. Flax linen and Haiku classes, whose variables live in a scope or a
  frame, go through ``_scoped`` instead.
* A function: found where the program names it: a global of the function's
  own module or of the program's, or a free variable of the program.

Without ``blocks=``, module classes name themselves (:func:`repeated_modules`):
an Equinox or Flax NNX module class with two or more instances in what the
program receives (its arguments, the values it closes over) is a block, as if
the user had named it; so is one with two or more nodes in a Flax NNX
``GraphDef`` it receives, closes over or reads as a global, itself or in a
function of the project it calls (a step that merges its model inside, or in
its loss). Its calls that repeat with the same structure become
regions; a call made once (a head, an embedding) is inlined back into its glue
by the block finder, as every block called once is. (Fewer than five small
layers are not blocks: see ``_shallow``.)
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._jax import Tracer
from .._keys._closure import values_reached
from .._keys._text import stable_repr
from .._stats import set_during

__all__ = [
    "array_body",
    "Found",
    "check_blocks",
    "from_a_framework",
    "jitted_call",
    "named_blocks",
    "repeated_modules",
    "swapped_calls",
    "typed_text",
]

# The module frameworks whose instances are pytrees the program receives (or
# closes over), by the module that defines their base class.
_MODULE_BASES = (("equinox", "Module"), ("flax.nnx", "Module"))


def check_blocks(blocks: Any) -> tuple[Any, ...]:
    """``blocks`` as a tuple of functions and classes.

    Raises:
      TypeError: an item is neither (naming it).
    """
    items = tuple(blocks) if isinstance(blocks, list | tuple) else (blocks,)
    for item in items:
        if not (isinstance(item, type) or isinstance(item, types.FunctionType)):
            raise TypeError(
                f"jaxaot.jit: blocks must be functions or module classes, got "
                f"{type(item).__name__}: {item!r:.60}"
            )
        if isinstance(item, type) and item.__flags__ & _IMMUTABLE_TYPE:
            # (Its calls are found by wrapping the class's __call__.)
            raise TypeError(
                f"jaxaot.jit: blocks must be functions or module classes, got the "
                f"built-in type {item.__qualname__}"
            )
    return items


#: ``Py_TPFLAGS_IMMUTABLETYPE``: a built-in or extension type, whose methods
#: cannot be replaced.
_IMMUTABLE_TYPE = 1 << 8


def _module_bases() -> tuple[type, ...]:
    """The module base classes of the frameworks this process imported (none is
    imported here: a program that uses one has imported it)."""
    bases = (getattr(sys.modules.get(module), name, None) for module, name in _MODULE_BASES)
    return tuple(base for base in bases if isinstance(base, type))


def _is_module(x: Any) -> bool:
    return isinstance(x, _module_bases())


class _Census:
    """The module instances in a program's inputs, per class: how many, and the
    classes that enclose every one of them."""

    def __init__(self) -> None:
        self.count: dict[type, int] = {}
        self.enclosed_by: dict[type, frozenset[type]] = {}
        self.fewest: dict[type, int] = {}  # the fewest in one root holding some

    @contextlib.contextmanager
    def root(self) -> Iterator[None]:
        """Counts what the block adds as one root's instances (see ``fewest``)."""
        before = dict(self.count)
        try:
            yield
        finally:
            for cls, n in self.count.items():
                added = n - before.get(cls, 0)
                if added:
                    self.fewest[cls] = min(self.fewest.get(cls, added), added)

    def add(self, module: Any, enclosing: frozenset[type]) -> None:
        cls = type(module)
        self.count[cls] = self.count.get(cls, 0) + 1
        self.enclosed_by[cls] = self.enclosed_by.get(cls, enclosing) & enclosing

    def count_graph(self, graph: Any) -> None:
        """Counts the module nodes of a Flax NNX GraphDef (where they sit is not
        read: nothing encloses them)."""
        bases = _module_bases()
        for node in getattr(graph, "nodes", None) or ():
            cls = getattr(node, "type", None)
            if isinstance(cls, type) and issubclass(cls, bases):
                self.count[cls] = self.count.get(cls, 0) + 1
                self.enclosed_by.setdefault(cls, frozenset())

    def walk(self, obj: Any, enclosing: frozenset[type], depth: int = 0) -> None:
        """Counts the modules nested in the pytree ``obj`` (in modules included)."""
        if depth > 64:
            return
        is_leaf = lambda x: x is not obj and _is_module(x)  # noqa: E731
        for child in jax.tree_util.tree_leaves(obj, is_leaf=is_leaf):
            if child is not obj and _is_module(child):
                # An outermost module (the model, or an optimizer state's copy of
                # it, both in one train state) counts as a root of its own.
                with self.root() if not enclosing else contextlib.nullcontext():
                    self.add(child, enclosing)
                    self.walk(child, enclosing | {type(child)}, depth + 1)


def from_a_framework(cls: type) -> bool:
    """Whether ``cls`` is one of a framework's own layers (``eqx.nn.Linear``,
    ``nnx.LayerNorm``, ``hk.Linear``): inside a user's layer, a part of it, not
    a layer."""
    return getattr(cls, "__module__", "").split(".")[0] in ("equinox", "flax", "haiku")


#: Held while module classes have their ``__call__`` swapped for a trace (named
#: blocks, counted calls): two traces in two threads swapping one class would
#: each put back the other's, and calls elsewhere would run the swapped one.
SWAPPING = threading.RLock()

#: Whether the trace is inside a named block's call (its body is being traced).
_IN_BLOCK: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxaot_in_block", default=False)


class Found(NamedTuple):
    """What :func:`repeated_modules` found."""

    classes: tuple[type, ...]  # the module classes to make blocks of
    # Per class, its fewest instances in any one value holding some (the model, an
    # optimizer state's copy of it): how often a plain loop calls it, at most.
    fewest: dict[type, int]
    # A framework's layers every instance of which sits in another found class:
    # parts of that class's calls, never blocks of their own.
    parts: frozenset[type]


def repeated_modules(
    args: Sequence[Any], kwargs: dict[str, Any], program: Any, named: Sequence[Any] = ()
) -> Found:
    """The Equinox and Flax NNX module classes with two or more instances in
    ``args``, ``kwargs`` and the values ``program`` closes over: the blocks of a
    plain loop of layers, which no ``jax.jit`` or ``jax.checkpoint`` marks.

    A class every instance of which sits inside a class of ``named`` (the
    user's blocks) is a part of that block, not a block of its own (as a block,
    it would make the named one a wrapper of repeated calls, looked through).
    So are a framework's layers called inside a block (see :func:`named_blocks`)."""
    census = _Census()
    target = getattr(program, "__wrapped__", program)
    closed = []
    for cell in getattr(target, "__closure__", None) or ():
        try:
            closed.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    roots = (*args, *kwargs.values(), *closed)
    for root in roots:
        if not _holds_arrays(root):
            # (The static half of an Equinox model split by ``eqx.partition``,
            # passed as a static argument: the same layers as the arrays' half,
            # not more of them.)
            continue
        enclosing: frozenset[type] = frozenset()
        with census.root():
            if _is_module(root):
                census.add(root, enclosing)
                enclosing = frozenset([type(root)])
            try:
                census.walk(root, enclosing)
            except Exception:  # a value that is no pytree: it holds no module
                continue
    if not named:
        # Flax NNX's functional form: the step merges the model from a GraphDef
        # (an argument, or a value the program closes over or reads as a global)
        # and its state, so no module instance reaches it; the GraphDef names them.
        # (Not where the user named blocks: a GraphDef does not say which of its
        # classes sit inside them, and those are parts, not blocks.)
        for graph in _graphdefs((*roots, *values_reached(target))):
            with census.root():
                census.count_graph(graph)
    repeated = [
        c
        for c, n in census.count.items()
        if n >= 2 and any("__call__" in k.__dict__ for k in c.__mro__)
    ]
    # A class with one instance in each root that holds repeated layers is the
    # model, repeated only by copies of it (an optimizer's moments: optax.adam's
    # mu and nu), not a layer: its layers are the blocks.
    models = {
        c
        for c in repeated
        if census.fewest.get(c) == 1
        and any(c in census.enclosed_by[d] and census.fewest.get(d, 0) >= 2 for d in repeated)
    }
    repeated = [c for c in repeated if c not in models]
    outer = {c for c in named if isinstance(c, type)}
    classes = tuple(c for c in repeated if not (census.enclosed_by[c] & outer))
    found = set(classes)
    parts = frozenset(c for c in classes if from_a_framework(c) and census.enclosed_by[c] & found)
    return Found(classes, {c: census.fewest[c] for c in classes}, parts)


def _graphdefs(values: Sequence[Any]) -> list[Any]:
    """The Flax NNX GraphDefs among ``values`` and their pytree leaves."""
    graphlib = sys.modules.get("flax.nnx.graphlib")
    graph_type = getattr(graphlib, "GraphDef", None)
    if not isinstance(graph_type, type):
        return []
    found: dict[int, Any] = {}
    for value in values:
        try:
            leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda x: isinstance(x, graph_type))
        except Exception:  # no pytree
            continue
        for leaf in (value, *leaves):
            if isinstance(leaf, graph_type):
                found[id(leaf)] = leaf
    return list(found.values())


def _holds_arrays(value: Any) -> bool:
    """Whether ``value`` holds arrays, or their types (a manifest's model of
    ``jax.ShapeDtypeStruct``s from ``jax.eval_shape``, as ``jaxaot precompile``
    is given it: its layers are the deployed model's)."""
    try:
        return any(
            _is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
            for leaf in jax.tree_util.tree_leaves(value)
        )
    except Exception:  # no pytree
        return False


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | Tracer)


def array_body(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], list[Any]]:
    """``fn``'s call on ``args`` and ``kwargs`` as a function of their array leaves
    (returned with it): every other leaf is fixed by the call."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    def body(*arrays: Any) -> Any:
        full = list(leaves)
        for i, a in zip(dynamic, arrays, strict=True):
            full[i] = a
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*a, **k)

    # Named as the user knows it (``Layer.__call__``): the block is named after it.
    body.__name__ = body.__qualname__ = getattr(fn, "__qualname__", "block")
    return body, [leaves[i] for i in dynamic]


def jitted_call(fn: Callable[..., Any], part: bool = False) -> Callable[..., Any]:
    """``fn`` called through ``jax.jit``: its array leaves are the jit's arguments,
    every other leaf is fixed by the call (part of the program). With ``part``,
    a call inside another block's call is a plain call (a part of that block).

    Calls of the same structure whose other leaves are equal (by type and value)
    share one ``jax.jit``, so JAX traces ``fn`` once for a model's layers, as
    ``jax.jit`` and ``eqx.filter_jit`` do for a function they have seen with
    those static values."""
    jits: dict[Any, Any] = {}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if part and _IN_BLOCK.get():
            return fn(*args, **kwargs)
        body, arrays = array_body(fn, args, kwargs)
        key = _fixed_part(args, kwargs)
        try:
            jitted = None if key is None else jits.get(key)
            if jitted is None:
                jitted = jax.jit(body)
                if key is not None:
                    jits[key] = jitted
        except Exception:  # a leaf whose equality is not a bool: traced on its own
            jitted = jax.jit(body)
        with set_during(_IN_BLOCK, True):
            return jitted(*arrays)

    return call


def typed_text(value: Any) -> tuple[Any, ...] | None:
    """``value`` as calls that share a trace must hold it alike: its stable text
    (typed: ``1`` is not ``1.0`` nor ``True``; a function by its code and what it
    closes over), its type (two enums made by one factory, each with its own
    values) and, for a class, the class itself (two made at run time under one
    name). ``None`` where it has no stable text."""
    text = stable_repr(value)
    if text is None:
        return None
    return type(value), value if isinstance(value, type) else None, text


def _fixed_part(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The structure of a call and its leaves that are not arrays, as values that
    are equal only where the calls compute alike: the structure with its text
    (an Equinox static field's ``1`` and ``1.0``, or ``0.0`` and ``-0.0``, are
    equal auxiliary data, but print apart), and each other leaf by
    :func:`typed_text`. ``None`` where a leaf has no such text: that call is
    traced on its own."""
    try:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        fixed = []
        for i, leaf in enumerate(leaves):
            if not _is_array(leaf):
                text = typed_text(leaf)
                if text is None:
                    return None
                fixed.append((i, text))
        key = (treedef, str(treedef), tuple(fixed))
        hash(key)
        return key
    except Exception:  # a structure that cannot be hashed or printed
        return None


def _fixed(value: Any) -> bool:
    """Whether an argument of a module call is a Python value the call fixes (a
    flag, a number, a name), rather than an array or a module to trace."""
    return isinstance(value, bool | int | float | complex | str | enum.Enum) or value is None


def _class_call(cls: type, part: bool) -> Callable[..., Any]:
    """The ``__call__`` ``cls`` has during the trace (see the module docstring)."""
    original = cls.__call__  # type: ignore[operator]
    if any(getattr(c, "__module__", "").startswith("flax.nnx") for c in cls.__mro__):
        from flax import nnx

        @functools.wraps(original)
        def named(self: Any, *args: Any, **kwargs: Any) -> Any:
            return original(self, *args, **kwargs)

        # Named as the user knows it (``Block.__call__``): the block is named after it.
        named.__name__ = named.__qualname__ = getattr(original, "__qualname__", "block")
        jitted: dict[tuple[tuple[int, ...], tuple[str, ...]], Any] = {}

        @functools.wraps(original)
        def nnx_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if part and _IN_BLOCK.get():
                return original(self, *args, **kwargs)
            # Python values (``deterministic=True``) are fixed by the call, as the
            # program around it sees them, not traced (``self`` is argument 0).
            static = (
                tuple(i + 1 for i, a in enumerate(args) if _fixed(a)),
                tuple(sorted(k for k, v in kwargs.items() if _fixed(v))),
            )
            block = jitted.get(static)
            if block is None:
                block = jitted[static] = nnx.jit(
                    named, static_argnums=static[0], static_argnames=static[1]
                )
            with set_during(_IN_BLOCK, True):
                return block(self, *args, **kwargs)

        return nnx_call
    return jitted_call(original, part)


@contextlib.contextmanager
def named_blocks(
    blocks: Sequence[Any], program: Callable[..., Any], parts: Sequence[type] = ()
) -> Iterator[None]:
    """During the block, calls of ``blocks`` (classes and functions) are inner jit
    calls, where ``program`` (the traced function) can reach them. Those of the
    classes in ``parts`` (a framework's layers no user named) are so only
    outside other blocks' calls: an ``eqx.nn.Linear`` in a user's ``Block`` is a
    part of the block (as a block, it would make the user's a wrapper of
    repeated calls, looked through), one in a plain loop a block."""
    classes = [block for block in blocks if isinstance(block, type)]
    calls = swapped_calls(classes, lambda cls: _class_call(cls, cls in parts))
    with calls, contextlib.ExitStack() as undo:  # (undone in reverse, as a stack)
        for block in blocks:
            if not isinstance(block, type):
                for step in _rebind(block, jitted_call(block), program):
                    undo.callback(step)
        yield


@contextlib.contextmanager
def swapped_calls(
    classes: Sequence[type], call_for: Callable[[type], Callable[..., Any]]
) -> Iterator[None]:
    """During the block, each of ``classes`` has ``call_for(cls)`` as its
    ``__call__`` (made from the class's own, which it may call); one such block
    at a time in the process (:data:`SWAPPING`)."""
    if not classes:
        yield
        return
    with SWAPPING, contextlib.ExitStack() as undo:
        for cls in classes:
            previous = cls.__dict__.get("__call__")
            setattr(cls, "__call__", call_for(cls))  # noqa: B010
            undo.callback(_restore_attr, cls, "__call__", previous)
        yield


def _restore_attr(obj: Any, name: str, previous: Any) -> None:
    if previous is None:
        delattr(obj, name)
    else:
        setattr(obj, name, previous)


#: How many functions :func:`_rebind` looks through for a block's function.
_MAX_REACHED = 256


def _reached(program: Any) -> list[Any]:
    """The Python functions ``program`` reaches through closures (the function
    itself, those in its closure cells, theirs, ...; through partials and
    wrappers), breadth first: where a step finds its loss, and the loss its layer."""
    found: list[Any] = []
    seen: set[int] = set()
    queue = [program]
    while queue and len(found) < _MAX_REACHED:
        f = queue.pop(0)
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, functools.partial):
            queue.extend([f.func, *f.args, *f.keywords.values()])
            continue
        wrapped = getattr(f, "__wrapped__", None)  # (a decorator's or jax.jit's function)
        if wrapped is not None:
            queue.append(wrapped)
        if not isinstance(f, types.FunctionType):
            continue
        found.append(f)
        for cell in f.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value):
                queue.append(value)
    return found


def _rebind(fn: Any, wrapped: Any, program: Any) -> list[Callable[[], None]]:
    """Binds ``wrapped`` wherever ``program`` finds ``fn`` by name: the globals of
    ``fn``'s module and of the modules of the functions ``program`` reaches
    through closures (:func:`_reached`), and their free variables."""
    undo: list[Callable[[], None]] = []
    reached = _reached(program)
    namespaces = [getattr(fn, "__globals__", None), *(f.__globals__ for f in reached)]
    seen: set[int] = set()
    for namespace in namespaces:
        if namespace is None or id(namespace) in seen:
            continue
        seen.add(id(namespace))
        for name, value in list(namespace.items()):
            if value is fn:
                namespace[name] = wrapped
                undo.append(functools.partial(namespace.__setitem__, name, fn))
    for f in reached:
        for cell in f.__closure__ or ():
            try:
                if cell.cell_contents is fn:
                    cell.cell_contents = wrapped
                    undo.append(functools.partial(setattr, cell, "cell_contents", fn))
            except ValueError:  # an empty cell
                continue
    return undo
