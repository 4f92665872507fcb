"""Blocks of Flax linen and Haiku models, whose parameters live in a scope or a
frame rather than in the module objects the program receives.

A plain loop of linen or Haiku layers marks no block, and its modules are not
in the program's arguments, so :func:`._named.repeated_modules` cannot count
them. Both frameworks let a caller see every module method call
(``nn.intercept_methods``, ``hk.intercept_methods``), so:

* :func:`counting` watches a trace of the program and records each module
  ``__call__`` (its class, the types of its arguments, the classes of the calls
  around it); :meth:`Calls.repeated` names the classes called two or more times
  with the same types, outermost only (a ``Dense`` inside a repeated ``Block``
  is part of the block).
* :func:`scoped_blocks` then makes each call of those classes an inner ``jit``
  call, as ``blocks=`` does for other module classes, with the module's
  variables passed in as arrays:

  - linen: the module unbound from its scope and applied to its own variables.
    Only where that computes what the scope would: not while initializing, not
    with mutable collections in the scope (such a call is left inline, with a
    DEBUG reason). A scope's random streams are made where the layer is called
    and passed in (``_draws``), so its draws are those it makes inline.
  - Haiku: the call with the transform's state and random sequence threaded in
    and out, as ``hk.remat`` threads it; the parameters it reads are values of
    the program around it (the whole state is threaded while initializing);
    the inputs a block does not use are pruned before it is keyed
    (``_component._blocks``).

The counting trace is a trace of its own: a program is traced a second time
only when its first trace found no repeated block and a linen or Haiku class
repeats, more than a few times or in big calls (``_tracing.trace``,
``_shallow``).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .._stats import set_during
from ._auto import module_ended, note
from ._draws import Refused, drawn_call
from ._named import from_a_framework, jitted_call, typed_text

__all__ = ["Calls", "counting", "is_scoped", "scoped_blocks"]


#: While set, module calls run as they are (inside a block's own trace).
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxaot_scoped_inside", default=False
)


def _framework(cls: type) -> str | None:
    for c in cls.__mro__:
        module = getattr(c, "__module__", "") or ""
        if module.startswith("flax.linen"):
            return "linen"
        if module.startswith("haiku"):
            return "haiku"
    return None


def is_scoped(cls: type) -> bool:
    """Whether ``cls`` is a Flax linen or Haiku module class."""
    return _framework(cls) is not None


def _intercepts() -> list[Callable[[Any], Any]]:
    """The ``intercept_methods`` of the frameworks this process imported (none is
    imported here: a program that uses one has imported it)."""
    modules = [sys.modules.get(name) for name in ("flax.linen", "haiku")]
    return [
        m.intercept_methods for m in modules if m is not None and hasattr(m, "intercept_methods")
    ]


def _types(args: Any, kwargs: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    return (
        str(treedef),
        tuple(
            (tuple(leaf.shape), str(leaf.dtype))
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
            else (type(leaf).__qualname__, repr(leaf)[:80])
            for leaf in leaves
        ),
    )


class Calls:
    """The module calls of one counting trace."""

    def __init__(self) -> None:
        self.calls: list[tuple[type, tuple[Any, ...], frozenset[type]]] = []
        self._around: list[type] = []

    def see(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        if context.method_name != "__call__" or _framework(type(context.module)) is None:
            return next_fun(*args, **kwargs)
        cls = type(context.module)
        self.calls.append((cls, _types(args, kwargs), frozenset(self._around)))
        self._around.append(cls)
        try:
            return next_fun(*args, **kwargs)
        finally:
            self._around.pop()
            if _framework(cls) == "linen":
                module_ended(_method(cls))

    def repeated(self) -> tuple[type, ...]:
        """The classes called two or more times with the same argument types,
        with a call that no other such class's call encloses."""
        return _outermost_repeats(self.calls)

    def wraps_layers(self, name: str) -> bool:
        """Whether the latest call of the module method ``name`` (``Block.__call__``)
        calls a layer: a class of the user's (not the framework's own layers)
        called two or more times with the same types, not inside another such
        call. A lifted transform around it (``nn.jit``) then wraps the layers
        rather than being one of them."""
        starts = [i for i, (cls, _, _) in enumerate(self.calls) if _method(cls) == name]
        if not starts:
            return False
        inside = [c for c in self.calls[starts[-1] + 1 :] if not from_a_framework(c[0])]
        return bool(_outermost_repeats(inside))


def _outermost_repeats(
    calls: list[tuple[type, tuple[Any, ...], frozenset[type]]],
) -> tuple[type, ...]:
    counts = collections.Counter((cls, types) for cls, types, _ in calls)
    repeats = {cls for (cls, _), n in counts.items() if n >= 2}
    return tuple(
        dict.fromkeys(c for c, _, around in calls if c in repeats and not around & repeats)
    )


def _method(cls: type) -> str:
    return f"{cls.__qualname__}.__call__"


#: Marks of counting traces: each one its own (see :func:`counting`).
_COUNTING_MARKS = itertools.count()


@contextlib.contextmanager
def counting() -> Iterator[Calls]:
    """Records the linen and Haiku module calls made during the block."""
    calls = Calls()
    with contextlib.ExitStack() as stack:
        if "flax.linen" in sys.modules and _fresh_linen_jits():
            # ``nn.jit`` gives back a trace it cached (another program's, or one
            # made before jaxaot.jit saw the model) without running the module
            # calls in it: they would go uncounted. Traced afresh.
            stack.enter_context(set_during(_LINEN_MARK, -1 - next(_COUNTING_MARKS)))
        for intercept in _intercepts():
            stack.enter_context(intercept(calls.see))
        yield calls


def _named(fn: Callable[..., Any], cls: type) -> Callable[..., Any]:
    # Named as the user knows it (``Block.__call__``): the block is named after it.
    fn.__name__ = "__call__"
    fn.__qualname__ = f"{cls.__qualname__}.__call__"
    return fn


def _inside(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with set_during(_INSIDE, True):
            return fn(*args, **kwargs)

    return run


def _linen_refusal(module: Any) -> str | None:
    scope = getattr(module, "scope", None)
    if scope is None:
        return "the module is not bound to a scope"
    if module.is_initializing():
        return "its variables are being initialized"
    if scope.mutable:
        return "its scope has mutable collections"
    return None


def _linen_call(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    module = context.module
    cls = type(module)
    refusal = _linen_refusal(module)
    if refusal is None and module.scope.rngs:
        try:
            return drawn_call(module, args, kwargs, lambda body: _inside(_named(body, cls)))
        except Refused as why:
            refusal = str(why)
    if refusal is not None:
        note(f"{cls.__qualname__}.__call__", f"left inline: {refusal}")
        return next_fun(*args, **kwargs)
    unbound, variables = module.unbind()
    jits = _LINEN_JITS.get()
    key = _linen_key(unbound) if jits is not None else None
    if jits is None or key is None:
        return _linen_jit(unbound, cls)(variables, *args, **kwargs)
    if key not in jits:
        jits[key] = _linen_jit(unbound, cls)
    return jits[key](variables, *args, **kwargs)


def _linen_jit(unbound: Any, cls: type) -> Callable[..., Any]:
    def body(variables: Any, *args: Any, **kwargs: Any) -> Any:
        return unbound.apply(variables, *args, **kwargs)

    return jitted_call(_inside(_named(body, cls)))


#: The block calls of linen layers made in this trace, by the layer's class and
#: configuration (:func:`_linen_key`): the layers of a model share one, so that
#: JAX traces the layer once and gives every later layer of the same types that
#: trace, as ``nn.jit`` does for a module it has seen (so a body that reads
#: Python state while it is traced reads it once per configuration). One per trace
#: (:func:`scoped_blocks`): a layer's trace depends on the trace around it
#: (``_tracing.run``'s contexts).
_LINEN_JITS: contextvars.ContextVar[dict[Any, Callable[..., Any]] | None] = contextvars.ContextVar(
    "jaxaot_linen_jits", default=None
)


def _linen_key(unbound: Any) -> Any:
    """A linen layer by what its calls compute, short of their arguments: its
    class and each of its fields but its name and parent by ``typed_text`` (as
    ``nn.jit`` keys its traces by its fields, but typed: a field's ``1`` is not
    ``1.0``). ``None`` where a field has no such
    text (a submodule, an array, an iterator): the layer is then traced on its
    own."""
    if not dataclasses.is_dataclass(unbound):
        return None
    texts = []
    for field in dataclasses.fields(unbound):
        if field.name in ("parent", "name") or not hasattr(unbound, field.name):
            continue
        text = typed_text(getattr(unbound, field.name))
        if text is None:
            return None
        texts.append((field.name, text))
    return (type(unbound), tuple(texts))


def _haiku_call(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    cls = type(context.module)
    try:  # Haiku's own state threading, as hk.remat uses it
        from haiku._src import base, stateful
    except ImportError:  # pragma: no cover - a Haiku without it
        note(f"{cls.__qualname__}.__call__", "left inline: this Haiku cannot thread its state")
        return next_fun(*args, **kwargs)

    if not base.current_frame().params_frozen:
        # Initializing (the call makes parameters): the whole state in and out,
        # as hk.remat threads it.
        def whole(*args: Any, **kwargs: Any) -> Any:
            return next_fun(*args, **kwargs)

        threaded = stateful.thread_hk_state_in_kwargs(jitted_call)
        return threaded(_inside(_named(whole, cls)))(*args, **kwargs)

    # Applying: the block reads its parameters from the frame, as values of the
    # program around it, so its jit takes the ones it reads. Handing every layer the whole
    # model's parameters made a deep model's trace quadratic in its depth. State
    # and random sequence are threaded in and out.
    def body(hk_state: Any, *args: Any, **kwargs: Any) -> Any:
        with (
            stateful.temporary_internal_state(hk_state, share_python_state=True),
            base.push_jax_trace_level(),
        ):
            out = next_fun(*args, **kwargs)
            after = stateful.internal_state(params=False)
            changed = stateful.difference(hk_state._replace(params={}), after._replace(params={}))
        return out, changed

    state_in = stateful.internal_state(params=False)
    out, changed = jitted_call(_inside(_named(body, cls)))(state_in, *args, **kwargs)
    stateful.update_internal_state(changed)
    return out


class _Wrapper:
    def __init__(self, classes: frozenset[type]) -> None:
        self.classes = classes

    def call(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        cls = type(context.module)
        if _INSIDE.get() or context.method_name != "__call__" or cls not in self.classes:
            return next_fun(*args, **kwargs)
        if _framework(cls) == "linen":
            return _linen_call(next_fun, args, kwargs, context)
        return _haiku_call(next_fun, args, kwargs, context)


#: While set, linen's ``nn.jit`` keys its traces apart (see :func:`_fresh_linen_jits`).
_LINEN_MARK: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "jaxaot_linen_mark", default=None
)
_LINEN_PATCH = threading.Lock()


def _fresh_linen_jits() -> bool:
    """Makes linen's ``nn.jit`` trace its function again while ``_LINEN_MARK`` is
    set: ``nn.jit`` caches its trace by the module's hash (``_HashableProxy``), so
    a model under ``nn.jit`` (gemma's) traced once without its layers as blocks
    would give that trace back. The hash is mixed with the mark, only while one
    is set (in this context); otherwise ``nn.jit`` works as it did."""
    transforms = sys.modules.get("flax.linen.transforms")
    proxy = getattr(transforms, "_HashableProxy", None)
    with _LINEN_PATCH:
        if proxy is None or getattr(proxy, "_jaxaot_marked", False):
            return proxy is not None
        original = proxy.__dict__.get("from_module")
        if not isinstance(original, classmethod):
            return False

        def from_module(cls: Any, module: Any) -> Any:
            made = original.__func__(cls, module)
            mark = _LINEN_MARK.get()
            return made if mark is None else cls(made.module_ref, hash((made.hash_key, mark)))

        proxy.from_module = classmethod(from_module)
        proxy._jaxaot_marked = True
        return True


@contextlib.contextmanager
def scoped_blocks(classes: tuple[type, ...]) -> Iterator[None]:
    """During the block, calls of the linen and Haiku module ``classes`` are inner
    jit calls (see the module docstring)."""
    if not classes:
        yield
        return
    wrapper = _Wrapper(frozenset(classes))
    with contextlib.ExitStack() as stack:
        stack.enter_context(set_during(_LINEN_JITS, {}))
        if any(_framework(c) == "linen" for c in classes) and _fresh_linen_jits():
            mark = hash(tuple(sorted(f"{c.__module__}.{c.__qualname__}" for c in classes)))
            stack.enter_context(set_during(_LINEN_MARK, mark))
        for intercept in _intercepts():
            stack.enter_context(intercept(wrapper.call))
        yield
